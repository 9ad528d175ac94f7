"""Free TCP ports on 127.0.0.1, for servers that must be told their port before they start: the
picker `baton serve` uses (``baton/ports.py``)."""

from baton.ports import free_port

__all__ = ["free_port"]
