"""The TCP transport's wire format, shared by the block server and the reader.

Per connection (several reads may follow each other on one connection):

    server -> client  the greeting: a magic and the connection's nonce (``sockets.py``)
    client -> server  request header (REQUEST) + engine_id + request_id + block ids (uint32 each)
                      + the request's tag
    server -> client  reply header (REPLY): status, server block_bytes, total bytes, checksum
                      + the reply's tag
    server -> client  on OK only: the raw bytes of each coalesced run, in the order asked
    client -> server  one DONE byte once everything arrived and the checksum matched

The request's tag is the HMAC, under the hand-off key the header names, of the nonce, the header
and the body (``keyring.py``); a server that cannot check it answers UNAUTHORIZED and hangs up.
The reply's tag covers the request's tag and the reply header, so the reader knows that the
checksum it will trust came from a holder of the same key.

A request with no block ids is a release: the reader will not read this lease (it failed, or it
needs none of the blocks); the server drops the lease, reports it claimed, and replies OK with no
payload. A lease being read is never expired under the read (``leases.py``).

The server's greeting and replies are each 64 bytes, so a payload starts at a multiple of 64
bytes into the connection's stream and so at the same alignment in the reader's socket buffer as
in its destination. The kernel's copy out of a misaligned buffer ran at half the speed: a 4 MiB
loopback read took 1.9 ms with a 61-byte reply ahead of it and 0.83 ms with a 64-byte one (a
raw-socket experiment on the 2-core machine of docs/benchmarks.md); wire version 2 had 20- and
61-byte messages.

The checksum (``checksum.py``, xxh3-64) is computed per block, and the header carries the
checksum of those per-block values (big-endian uint64, in the order asked). Per-block values let
the server compute them when the lease is made, on a background thread, so for any subset or
order of the leased blocks the read itself pays no checksum pass on the sending side.
"""

from __future__ import annotations

import struct

# magic, len(engine_id), len(request_id), number of block ids, the client's block_bytes, key id
REQUEST = struct.Struct("!4sHHIQ8s")
REQUEST_MAGIC = b"BKVR"
# magic, status, the server's block_bytes, total payload bytes, checksum of the payload, padding
# (with its 32-byte tag, a reply is 64 bytes: see the module docstring)
REPLY = struct.Struct("!4sBQQQ3x")
REPLY_MAGIC = b"BKVA"
DONE = b"\x01"
# Bounds what a malformed or hostile header can make the server allocate.
MAX_BLOCKS_PER_READ = 1 << 22


def pack_request(
    key_id: str, engine_id: str, request_id: str, block_ids: list[int], block_bytes: int
) -> tuple[bytes, bytes]:
    """(header, body) of a read of ``block_ids`` (a release when there are none, with
    ``block_bytes`` 0); the tag follows them."""
    engine_b, request_b = engine_id.encode(), request_id.encode()
    head = REQUEST.pack(
        REQUEST_MAGIC,
        len(engine_b),
        len(request_b),
        len(block_ids),
        block_bytes,
        key_id.encode(),  # 8 characters (keyring.KEY_ID_CHARS)
    )
    return head, engine_b + request_b + struct.pack(f"!{len(block_ids)}I", *block_ids)


def coalesce(block_ids: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ids as (first_id, count), in the given order."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            first, count = runs[-1]
            runs[-1] = (first, count + 1)
        else:
            runs.append((block_id, 1))
    return runs
