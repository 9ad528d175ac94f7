"""Fake KV block servers that misbehave, for the decode side's fault handling: one that
stalls (accepts and never answers), hangs up mid-payload, or sends bytes failing the checksum."""

from __future__ import annotations

import contextlib
import socket
import threading

from baton.kv_transfer.tcp.wire import REPLY, REPLY_MAGIC, REQUEST

MODES = ("stall", "short", "corrupt")


class BadKVPeer:
    """Listens on a free 127.0.0.1 port until `close()`: `stall` accepts and never answers;
    `short` answers OK and hangs up halfway through the payload; `corrupt` sends the promised
    bytes with a wrong checksum."""

    def __init__(self, mode: str = "stall") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # close() ends accept() with an OSError
            while True:
                conn, _ = self.sock.accept()
                self.conns.append(conn)
                if self.mode == "stall":
                    continue
                head = conn.recv(REQUEST.size, socket.MSG_WAITALL)
                _, elen, rlen, nblocks, bpb = REQUEST.unpack(head)
                conn.recv(elen + rlen + 4 * nblocks, socket.MSG_WAITALL)
                total = nblocks * bpb
                conn.sendall(REPLY.pack(REPLY_MAGIC, 0, bpb, total, 12345))
                conn.sendall(bytes(total if self.mode == "corrupt" else total // 2))
                if self.mode == "short":
                    conn.close()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()
