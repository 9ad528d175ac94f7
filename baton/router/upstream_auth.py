"""What the router shows the engines: its upstream API key and how it checks https:// engines.

One rule for every request the router makes to an engine (proxied requests, hand-off steps,
health checks): the client's `Authorization` header never goes on, since with a router key it
is that key, and the engines' key (`upstream_api_key`), when there is one, goes instead. The
router thus never lends a client's credentials to an engine, and an engine never learns the
router's key.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping

from baton.router.config import RouterConfig

_AUTHORIZATION = "authorization"


class UpstreamAuth:
    """The headers and TLS settings of the router's requests to engines."""

    def __init__(self, config: RouterConfig) -> None:
        key = config.upstream_api_key
        self.headers: dict[str, str] = {_AUTHORIZATION: f"Bearer {key}"} if key else {}
        # aiohttp's `ssl=`: True verifies against the system's CAs; only https:// URLs use it.
        self.ssl: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=config.upstream_ca_certs)
            if config.upstream_ca_certs
            else True
        )

    def apply(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        """`headers` (lower-case names) with the client's Authorization replaced by ours."""
        if not self.headers and _AUTHORIZATION not in headers:
            return headers  # the common case costs no copy
        out = {k: v for k, v in headers.items() if k != _AUTHORIZATION}
        out.update(self.headers)
        return out
