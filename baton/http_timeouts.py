"""uvicorn's HTTP protocol with a deadline for reading each request, shared by the engine's and
the router's servers.

uvicorn times out only idle keep-alive connections: a client that connects and sends nothing,
or sends its headers or body a byte at a time and then stalls (slow loris), holds its
connection and its socket forever. Here every request must arrive whole (request line, headers
and body) within `read_timeout` seconds of its first byte (or of the connection, for the first
request); past that the connection is closed, and a request already handed to the app sees a
disconnect.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_READ_TIMEOUT = 30.0  # seconds; nginx gives 60 to headers and 60 between body reads


class _ReadTimeoutProtocol(HttpToolsProtocol):
    read_timeout = DEFAULT_READ_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.read_timeout, self._on_read_timeout)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _on_read_timeout(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request took over %.0f s to arrive",
                             self.read_timeout)  # fmt: skip
            self.transport.close()  # then connection_lost: a request in the app sees a disconnect

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()


def read_timeout_protocol(read_timeout: float) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with `read_timeout` seconds."""
    if read_timeout <= 0:
        raise ValueError(f"read_timeout must be > 0, got {read_timeout}")
    return type("ReadTimeoutProtocol", (_ReadTimeoutProtocol,), {"read_timeout": read_timeout})
