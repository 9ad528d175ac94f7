"""The serving side of the TCP KV wire for fake peers in tests: the greeting, a request read and
its tag checked, and replies tagged as a real block server tags them, under the tests' hand-off
key (`KEYS`: the secret tests/conftest.py puts in the environment, which the engines the tests
start share)."""

from __future__ import annotations

import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from baton.kv_transfer.keyring import TAG_BYTES, KeyRing
from baton.kv_transfer.nixl import channel
from baton.kv_transfer.params import KVTransferParams
from baton.kv_transfer.sockets import GREETING, GREETING_MAGIC
from baton.kv_transfer.tcp.reader import Lease
from baton.kv_transfer.tcp.wire import REPLY, REPLY_MAGIC, REQUEST

KEYS = KeyRing.load()


def lease_at(port: int, engine_id: str, request_id: str, keys: KeyRing = KEYS) -> Lease:
    """A lease on 127.0.0.1:`port` as a reader holding `keys` addresses it."""
    return Lease("127.0.0.1", port, engine_id, request_id, keys, keys.signing_key_id)


@dataclass
class Request:
    """One request a fake server received."""

    conn: socket.socket
    nonce: bytes
    key_id: str
    tag: bytes
    ids: list[int]
    block_bytes: int
    authentic: bool  # its tag checks under KEYS

    def reply(self, status: int, block_bytes: int, total: int, checksum: int) -> None:
        head = REPLY.pack(REPLY_MAGIC, status, block_bytes, total, checksum)
        tag = KEYS.tag(self.key_id, self.nonce, self.tag, head) or bytes(TAG_BYTES)
        self.conn.sendall(head + tag)


def greet(conn: socket.socket) -> bytes:
    """Sends a new connection's greeting; returns its nonce."""
    nonce = secrets.token_bytes(16)
    conn.sendall(GREETING.pack(GREETING_MAGIC, nonce))
    return nonce


def read_request(conn: socket.socket, nonce: bytes) -> Request:
    head = conn.recv(REQUEST.size, socket.MSG_WAITALL)
    _, elen, rlen, n, bpb, kid_b = REQUEST.unpack(head)
    rest = conn.recv(elen + rlen + 4 * n + TAG_BYTES, socket.MSG_WAITALL)
    body, tag = rest[:-TAG_BYTES], rest[-TAG_BYTES:]
    kid = kid_b.rstrip(b"\0").decode()
    ids = list(struct.unpack_from(f"!{n}I", body, elen + rlen))
    return Request(conn, nonce, kid, tag, ids, bpb, KEYS.check(kid, tag, nonce, head, body))


def side_call(port: int, message: channel.Message, keys: KeyRing = KEYS) -> channel.Reply | None:
    """One message to a NIXL side channel on its own connection, sealed under `keys`; its reply
    (None for a one-way Done)."""
    kid = keys.signing_key_id
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        _, nonce = GREETING.unpack(sock.recv(GREETING.size, socket.MSG_WAITALL))
        body = channel.encoder.encode(message)
        tag = keys.tag(kid, nonce, body) or b""
        channel.send_envelope(sock, channel.Envelope(kid, tag, body))
        if isinstance(message, channel.Done):
            time.sleep(0.1)
            return None
        payload = channel.recv_frame(sock)
        assert payload is not None
        return channel.reply_decoder.decode(channel.envelope_decoder.decode(payload).body)


def resigned(params: dict[str, Any], prompt_ids: list[int], **changes: Any) -> dict[str, Any]:
    """A prefill engine's `kv_transfer_params` with `changes`, signed again under `KEYS`: what
    only a holder of the service's key can make (a restarted engine's stale params, a lease
    that points at a misbehaving peer)."""
    parsed = KVTransferParams.parse({**params, **changes})
    assert parsed is not None and parsed.remote is not None
    return KVTransferParams.lease(parsed.remote.signed(KEYS, prompt_ids)).to_json()
