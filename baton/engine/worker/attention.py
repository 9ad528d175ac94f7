"""Transitional: `engine/config.py` still imports the backend names from here.

The attention layers are in `baton.engine.layers.attention`, the names in
`baton.engine.layers.backends`; delete this module once config.py imports them from there.
"""

from baton.engine.layers.backends import ATTENTION_BACKENDS

__all__ = ["ATTENTION_BACKENDS"]
