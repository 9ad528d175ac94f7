"""The NIXL transport's side channel: length-prefixed msgpack messages between a reader and a
serving engine, the reader's requests over pooled connections, and block-region helpers. Nothing
here needs the ``nixl`` package.

Every message travels in an `Envelope` with its tag under a hand-off key (``keyring.py``): the
reader's over the connection's nonce and the message, the server's over the reader's tag and
the reply. A server answers nothing but UNAUTHORIZED to a peer without the key, so the agent
metadata (which lets a peer READ the registered memory) goes only to holders of the key.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from dataclasses import dataclass

import msgspec

from baton.kv_transfer.checksum import XXH3
from baton.kv_transfer.keyring import KeyRing
from baton.kv_transfer.leases import Status
from baton.kv_transfer.sockets import (
    ExchangeError,
    KVConnectionPool,
    arm,
    is_timeout,
    recv_exact,
)

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("!I")
_MAX_FRAME = 64 << 20  # bounds what a malformed length can make either side allocate
_NOTIFY_MIN_TIMEOUT_S = 0.5  # a Done is sent even when the read used up its deadline


# ---- side-channel messages --------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", frozen=True):
    engine_id: str  # the reader's expectation; the reply carries the server's own id


class Lookup(msgspec.Struct, tag="lookup", frozen=True):
    engine_id: str
    request_id: str
    block_ids: list[int]
    block_bytes: int
    hold_s: float  # the reader's time left: the lease is not expired under the read before then


class Done(msgspec.Struct, tag="done", frozen=True):
    """One way: the blocks arrived and matched; the server frees them."""

    engine_id: str
    request_id: str


class Release(msgspec.Struct, tag="release", frozen=True):
    """The reader will not read (or failed to read) this lease; the server frees it now."""

    engine_id: str
    request_id: str


class Reply(msgspec.Struct, frozen=True):
    status: int
    engine_id: str = ""
    # Hello: what the reader needs to address the server's blocks
    agent_metadata: bytes = b""
    base_addr: int = 0
    num_blocks: int = 0
    block_bytes: int = 0
    mem_type: str = "DRAM"
    device_id: int = 0
    checksum: str = XXH3  # the kind of block checksum in `crcs` (checksum.py)
    # Lookup: the checksum of each asked block, in the order asked
    crcs: list[int] = []


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """A message or reply (``body``, encoded) with its tag under key ``key_id``."""

    key_id: str
    tag: bytes
    body: bytes


Message = Hello | Lookup | Done | Release
encoder = msgspec.msgpack.Encoder()
envelope_decoder = msgspec.msgpack.Decoder(Envelope)
message_decoder = msgspec.msgpack.Decoder(Message)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def send_envelope(sock: socket.socket, envelope: Envelope) -> None:
    payload = encoder.encode(envelope)
    sock.sendall(_FRAME.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame's payload; None on a clean EOF before it, ConnectionError on a short one."""
    head = recv_exact(sock, _FRAME.size)
    if head is None:
        return None
    (size,) = _FRAME.unpack(head)
    if size > _MAX_FRAME:
        raise ConnectionError(f"frame of {size} B exceeds {_MAX_FRAME} B")
    payload = recv_exact(sock, size) if size else b""
    if payload is None:
        raise ConnectionError("connection closed before the frame's payload")
    return payload


# ---- the reader's requests ---------------------------------------------------------------------


@dataclass(frozen=True)
class Channel:
    """A serving engine's side channel as a reader addresses it, and the key it proves itself
    with (the one that signed the lease's params)."""

    pool: KVConnectionPool
    host: str
    port: int
    keys: KeyRing
    key_id: str

    def seal(self, message: Message, nonce: bytes) -> Envelope:
        body = encoder.encode(message)
        tag = self.keys.tag(self.key_id, nonce, body)
        if tag is None:
            raise ExchangeError(f"UNAUTHORIZED: this engine does not hold key {self.key_id!r}")
        return Envelope(self.key_id, tag, body)


def call(peer: Channel, message: Message, deadline: float) -> Reply | str:
    """One request and its reply over the peer's pool; never raises: a failure comes back as
    ``"<CODE>: detail"``."""
    host, port = peer.host, peer.port

    def run(sock: socket.socket, nonce: bytes) -> Reply:
        try:
            arm(sock, deadline)
            sent = peer.seal(message, nonce)
            send_envelope(sock, sent)
            payload = recv_frame(sock)
            if payload is None:
                raise ConnectionError("connection closed before the reply")
            got = envelope_decoder.decode(payload)
            reply = reply_decoder.decode(got.body)
            # Only an OK needs proof: a refusal, forged or not, ends in a recompute.
            if reply.status == Status.OK and not peer.keys.check(
                peer.key_id, got.tag, nonce, sent.tag, got.body
            ):
                error = f"UNAUTHENTICATED: {host}:{port} did not prove the hand-off key"
                raise ExchangeError(error)
            return reply
        except msgspec.DecodeError as exc:
            raise ExchangeError(f"PROTOCOL: bad reply from {host}:{port}: {exc}") from None
        except OSError as exc:
            if is_timeout(exc):
                raise ExchangeError(f"DEADLINE: waiting for {host}:{port}") from None
            error = f"SHORT_READ: side channel to {host}:{port}: {exc}"
            raise ExchangeError(error, stale=True) from None

    return peer.pool.exchange(host, port, deadline, run)


def notify(peer: Channel, message: Done, deadline: float) -> None:
    """Sends a one-way message over the peer's pool; a lost Done leaves the lease to expire, as
    with TCP."""

    def run(sock: socket.socket, nonce: bytes) -> None:
        try:
            arm(sock, max(deadline, time.monotonic() + _NOTIFY_MIN_TIMEOUT_S))
            send_envelope(sock, peer.seal(message, nonce))
        except OSError as exc:
            raise ExchangeError(str(exc)) from None

    error = peer.pool.exchange(peer.host, peer.port, deadline, run)
    if error is not None:
        logger.debug("sending %s: %s", message, error)


# ---- block regions ----------------------------------------------------------------------------


def paired_runs(remote_ids: list[int], local_ids: list[int]) -> list[tuple[int, int, int]]:
    """(remote_first, local_first, count) runs where both sides' ids are consecutive: each run is
    one NIXL descriptor of ``count`` blocks on either side."""
    runs: list[tuple[int, int, int]] = []
    for remote, local in zip(remote_ids, local_ids, strict=True):
        if runs:
            r, loc, n = runs[-1]
            if r + n == remote and loc + n == local:
                runs[-1] = (r, loc, n + 1)
                continue
        runs.append((remote, local, 1))
    return runs


def split_runs(
    runs: list[tuple[int, int, int]], max_blocks: int
) -> list[list[tuple[int, int, int]]]:
    """The runs in order, cut into chunks of at most ``max_blocks`` blocks each."""
    chunks: list[list[tuple[int, int, int]]] = [[]]
    room = max_blocks
    for remote, local, count in runs:
        while count:
            if room == 0:
                chunks.append([])
                room = max_blocks
            take = min(count, room)
            chunks[-1].append((remote, local, take))
            remote, local, count, room = remote + take, local + take, count - take, room - take
    return chunks
