"""The NIXL transport's serving side: the side channel that answers readers' Hello, Lookup, Done
and Release for this engine's leases, to readers that prove the hand-off key (``channel.py``),
and the agent's progress while a read holds a lease."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import msgspec

from baton.kv_transfer.keyring import KeyRing
from baton.kv_transfer.leases import LeaseTable, Status
from baton.kv_transfer.nixl.channel import (
    Done,
    Envelope,
    Hello,
    Message,
    Release,
    Reply,
    encoder,
    envelope_decoder,
    message_decoder,
    recv_frame,
    send_envelope,
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
        keys: KeyRing,
    ) -> None:
        super().__init__(host, port, name="kv-nixl-accept")
        self._keys = keys
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

    def serve_one(self, conn: socket.socket, nonce: bytes) -> bool:
        payload = recv_frame(conn)
        if payload is None:
            return False
        try:
            got = envelope_decoder.decode(payload)
            if not self._keys.check(got.key_id, got.tag, nonce, got.body):
                self._refuse(conn, Status.UNAUTHORIZED)
                return False
            message = message_decoder.decode(got.body)
        except msgspec.DecodeError:
            self._refuse(conn, Status.BAD_REQUEST)
            return False
        reply = self._handle(message)
        if reply is not None:
            body = encoder.encode(reply)
            tag = self._keys.tag(got.key_id, nonce, got.tag, body) or b""
            send_envelope(conn, Envelope(got.key_id, tag, body))
        return True

    def _refuse(self, conn: socket.socket, status: Status) -> None:
        """A refusal, untagged, to a peer that proved nothing: not even this engine's id."""
        send_envelope(conn, Envelope("", b"", encoder.encode(Reply(status))))

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
