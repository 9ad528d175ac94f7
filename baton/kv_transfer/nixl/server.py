"""The NIXL transport's serving side: the side channel that answers readers' Hello, Lookup, Done
and Release for this engine's leases, and the agent's progress while a read holds a lease."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import msgspec

from baton.kv_transfer.leases import LeaseTable, Status
from baton.kv_transfer.nixl.channel import (
    Done,
    Hello,
    Message,
    Release,
    Reply,
    message_decoder,
    recv_frame,
    send_message,
)
from baton.kv_transfer.sockets import ThreadedServer

_PROGRESS_POLL_S = 0.0002  # the agent's progress while a read holds a lease
_PROGRESS_IDLE_S = 0.05  # how long the progress thread waits for a hold; bounds stop()


class SideChannelServer(ThreadedServer):
    """Serves one engine's leases to NIXL readers; ``hello`` is its answer to a Hello (the
    engine id, agent metadata and tensor layout readers need), ``agent`` its NIXL agent."""

    def __init__(
        self,
        host: str,
        port: int,
        leases: LeaseTable,
        hello: Reply,
        agent: Any,
    ) -> None:
        super().__init__(host, port, name="kv-nixl-accept")
        self._leases = leases
        self._hello = hello
        self._agent = agent
        self._progress: threading.Thread | None = None

    def start(self) -> int:
        """Starts the side channel and the progress thread; returns the side channel's port."""
        port = super().start()
        self._progress = threading.Thread(
            target=self._progress_loop, name=f"kv-nixl-progress-{port}", daemon=True
        )
        self._progress.start()
        return port

    def stop(self) -> None:
        """Stops both threads and closes every connection, well within a second."""
        super().stop()
        if self._progress is not None:
            self._progress.join(timeout=0.5)

    def _progress_loop(self) -> None:
        """Polls the agent while a read holds a lease: UCX over TCP needs the target to progress."""
        while not self._stopping.is_set():
            if not (self._leases.reading.wait(_PROGRESS_IDLE_S) and self._leases.holding()):
                continue
            with contextlib.suppress(Exception):
                self._agent.get_new_notifs()
            time.sleep(_PROGRESS_POLL_S)

    def serve_one(self, conn: socket.socket) -> bool:
        payload = recv_frame(conn)
        if payload is None:
            return False
        try:
            message = message_decoder.decode(payload)
        except msgspec.DecodeError:
            send_message(conn, Reply(Status.BAD_REQUEST, self._hello.engine_id))
            return False
        reply = self._handle(message)
        if reply is not None:
            send_message(conn, reply)
        return True

    def _handle(self, message: Message) -> Reply | None:
        own = self._hello.engine_id
        if isinstance(message, Hello):
            return self._hello if message.engine_id == own else Reply(Status.UNKNOWN_ENGINE, own)
        if isinstance(message, Done):
            self._leases.claim(message.engine_id, message.request_id)
            return None
        if isinstance(message, Release):
            return Reply(self._leases.claim(message.engine_id, message.request_id), own)
        status, crcs = self._leases.lookup(
            message.engine_id,
            message.request_id,
            message.block_ids,
            message.block_bytes,
            message.hold_s,
        )
        return Reply(status, own, crcs=crcs)
