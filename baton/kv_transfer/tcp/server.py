"""The TCP transport's block server (the prefill side): serves leased blocks of this engine's KV
cache straight from host tensor memory, or staged through host buffers (``staging.py``), one read
or release at a time per connection (``wire.py``), to readers that prove the hand-off key."""

from __future__ import annotations

import socket
import struct

import torch

from baton.kv_transfer.checksum import byte_view, combine
from baton.kv_transfer.keyring import TAG_BYTES, KeyRing
from baton.kv_transfer.leases import MAX_HOLD_S, LeaseTable, Status
from baton.kv_transfer.sockets import ThreadedServer, recv_exact, send_all
from baton.kv_transfer.tcp.staging import StagingPool
from baton.kv_transfer.tcp.wire import (
    DONE,
    MAX_BLOCKS_PER_READ,
    REPLY,
    REPLY_MAGIC,
    REQUEST,
    REQUEST_MAGIC,
    coalesce,
)


class KVBlockServer(ThreadedServer):
    """Serves leased KV blocks of one engine's cache to remote readers (the prefill side).

    The engine's side is ``leases`` (a `LeaseTable`: thread-safe, never blocking on I/O, so the
    busy loop may call it every step). A lease must cover blocks the engine will not write or free
    until the lease is released, expired, or reported claimed.

    With ``staging`` (a pool over ``kv_cache``; required for a cache outside host memory) the
    blocks go out through its host buffers, chunk by chunk (`staging.Stager.send`); the bytes on
    the wire are the same. The pool's owner closes it.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        engine_id: str,
        keys: KeyRing,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        io_timeout: float = 30.0,
        staging: StagingPool | None = None,
    ) -> None:
        self._staging = staging
        self._view = None if staging is not None else byte_view(kv_cache)
        self._num_blocks = kv_cache.shape[0]
        self._keys = keys
        self.leases = LeaseTable(kv_cache, engine_id)
        super().__init__(host, port, io_timeout=io_timeout, name="kv-server")

    def stop(self) -> None:
        super().stop()
        self.leases.stop()

    # ------------------------------------------------------------------ per connection

    def serve_one(self, conn: socket.socket, nonce: bytes) -> bool:
        head = recv_exact(conn, REQUEST.size)
        if head is None:
            return False
        magic, engine_len, request_len, num_blocks, client_block_bytes, kid_b = REQUEST.unpack(head)
        # Bounded before the body is read: a peer without the key allocates nothing large.
        if magic != REQUEST_MAGIC or num_blocks > min(MAX_BLOCKS_PER_READ, self._num_blocks):
            self._reply(conn, Status.BAD_REQUEST)
            return False
        body = recv_exact(conn, engine_len + request_len + 4 * num_blocks + TAG_BYTES)
        if body is None:
            return False
        body, tag = body[:-TAG_BYTES], body[-TAG_BYTES:]
        kid = kid_b.rstrip(b"\0").decode("ascii", "replace")
        if not self._keys.check(kid, tag, nonce, head, body):
            # Nothing about the leases goes to a peer without the key, not even a status.
            self._reply(conn, Status.UNAUTHORIZED)
            return False
        engine_id = body[:engine_len].decode("utf-8", "replace")
        request_id = body[engine_len : engine_len + request_len].decode("utf-8", "replace")
        ids = list(struct.unpack_from(f"!{num_blocks}I", body, engine_len + request_len))
        proof = (kid, nonce, tag)
        if not ids:
            self._reply(conn, self.leases.claim(engine_id, request_id), proof)
            return True

        # The hold's own bound is a backstop: the read ends (end_read) well before, bounded by
        # the server's I/O timeout on every send and receive.
        status, sums = self.leases.lookup(
            engine_id, request_id, ids, client_block_bytes, MAX_HOLD_S
        )
        if status != Status.OK:
            self._reply(conn, status, proof)
            return True
        try:
            head = self._reply_head(Status.OK, proof, len(ids) * self.leases.block_bytes, sums)
            return self._send(conn, head, engine_id, request_id, ids)
        finally:
            self.leases.end_read(request_id)

    def _send(
        self, conn: socket.socket, head: bytes, engine_id: str, request_id: str, ids: list[int]
    ) -> bool:
        """The OK reply ``head`` and the blocks behind it, then the reader's DONE."""
        bpb = self.leases.block_bytes
        if self._staging is not None:
            conn.sendall(head)
            with self._staging.stager() as stager:
                stager.send(conn, ids)
        else:
            assert self._view is not None
            view = self._view
            # One gathered send: the reader wakes to the reply with the payload right behind it.
            runs = [view[first * bpb : (first + count) * bpb] for first, count in coalesce(ids)]
            send_all(conn, [head, *runs])
        done = recv_exact(conn, 1)
        if done != DONE:
            return False
        self.leases.claim(engine_id, request_id)
        return True

    def _reply(
        self, conn: socket.socket, status: Status, proof: tuple[str, bytes, bytes] | None = None
    ) -> None:
        """A reply with no payload (see `_reply_head`)."""
        conn.sendall(self._reply_head(status, proof))

    def _reply_head(
        self,
        status: Status,
        proof: tuple[str, bytes, bytes] | None,
        total: int = 0,
        sums: list[int] | None = None,
    ) -> bytes:
        """A reply header and its tag over the request's (``proof``: key id, nonce and request
        tag; zeros for a peer that proved nothing); ``sums``: the checksums of the blocks sent."""
        checksum = combine(sums) if sums else 0
        head = REPLY.pack(REPLY_MAGIC, status, self.leases.block_bytes, total, checksum)
        tag = self._keys.tag(proof[0], proof[1], proof[2], head) if proof else None
        return head + (tag or bytes(TAG_BYTES))
