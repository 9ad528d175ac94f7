"""Fake KV block servers that misbehave, for the decode side's fault handling: one that
stalls (accepts and never answers), hangs up mid-payload, or sends bytes failing the checksum.
They hold the tests' hand-off key (`kv_wire.KEYS`), so what fails is what each one breaks."""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.support.kv_wire import greet, read_request

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
                request = read_request(conn, greet(conn))
                bpb = request.block_bytes
                total = len(request.ids) * bpb
                request.reply(0, bpb, total, 12345)
                conn.sendall(bytes(total if self.mode == "corrupt" else total // 2))
                if self.mode == "short":
                    conn.close()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()
