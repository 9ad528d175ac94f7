"""An engine's compatibility fingerprint: everything that must be equal on both sides of a hand-off
for a KV block to mean the same thing to the decode engine as to the prefill engine that wrote it.
Computed once per engine start (``baton/engine/compatibility.py``), carried in the signed
hand-off params, compared by the decode engine before it pulls, shown in ``/health``, and used by
the router to pair only engines that agree. Torch-free.
"""

from __future__ import annotations

import hashlib

import msgspec

# Baton's KV wire version: the block layout in memory and the TCP/NIXL exchanges. Bumped when
# either changes; 2 is the authenticated exchange of issue 14, 3 pads the TCP greeting and reply to
# 64 bytes each (tcp/wire.py).
KV_WIRE_VERSION = "3"


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Each field a short value or hash; two engines may exchange KV only when all are equal."""

    model: str = ""  # the architecture config (config.json, less its bookkeeping keys)
    weights: str = ""  # an identity of the checkpoint's bytes (see compatibility.py)
    dtype: str = ""  # the compute dtype the engine resolved
    kv_cache_dtype: str = ""
    block_size: str = ""
    kv_layout: str = ""  # one rank's block shape, and the tensor-parallel split
    tokenizer: str = ""  # the tokenizer's files
    chat_template: str = ""
    wire: str = KV_WIRE_VERSION

    @property
    def digest(self) -> str:
        """One value for the whole fingerprint (32 hex), as `/health` shows it."""
        raw = msgspec.msgpack.encode(msgspec.structs.astuple(self))
        return hashlib.blake2b(raw, digest_size=16).hexdigest()

    def differences(self, other: Fingerprint) -> list[str]:
        """The names of the fields that differ, in field order."""
        return [f for f in self.__struct_fields__ if getattr(self, f) != getattr(other, f)]


def describe_mismatch(prefill: Fingerprint, decode: Fingerprint) -> str | None:
    """Why KV from `prefill` must not be read by `decode` (the first field that differs and its
    two values), or None when they agree."""
    fields = prefill.differences(decode)
    if not fields:
        return None
    first = fields[0]
    also = f" (also {', '.join(fields[1:])})" if fields[1:] else ""
    return (
        f"INCOMPATIBLE: {first} differs: prefill engine {getattr(prefill, first) or 'unknown'}, "
        f"decode engine {getattr(decode, first)}{also}"
    )
