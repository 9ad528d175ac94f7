"""The prefix cache's block hashes, one definition for the engine's block pool and the router's
index: both must compute the same value for the same tokens, so neither imports the other.

A full block's hash chains its parent's: equal hashes mean equal prefixes, not just equal
blocks. sha256 rather than Python's `hash()`: a collision would serve another prompt's KV, and
the router (another process, another machine) must compute the same value. There is no random
seed (vLLM draws one unless PYTHONHASHSEED is set): the chain starts from the request's
`cache_salt` when it has one, so that requests with different salts (tenants) never share a
block, and from nothing otherwise.

KV events and the router's index carry the hash as vLLM's events do by default: the digest's
last 8 bytes as a big-endian unsigned integer (`external_hash`).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes
HASH_SCHEME = "sha256-salted/1"  # what /health advertises; the router indexes only this scheme


def salt_root(cache_salt: str | None) -> BlockHash | None:
    """The parent of a request's first block: None without a salt, else a digest of the salt
    (a domain prefix keeps it apart from any block's hash)."""
    if not cache_salt:
        return None
    return hashlib.sha256(b"baton-cache-salt\0" + cache_salt.encode()).digest()[:16]


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block of `token_ids` after the block hashed `parent_hash`."""
    ids = array("q", token_ids)  # int64, little-endian on the wire whatever the machine
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.sha256(parent_hash or b"")
    h.update(ids.tobytes())
    return h.digest()[:16]


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    start: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids`, first block first. `start`: hashes
    already computed for the leading blocks (extended, not recomputed)."""
    hashes = list(start)
    parent = hashes[-1] if hashes else salt_root(cache_salt)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def external_hash(block_hash: BlockHash) -> int:
    """The block hash as KV events carry it (vLLM's int form: the last 8 bytes, big-endian)."""
    return int.from_bytes(block_hash[-8:], "big")
