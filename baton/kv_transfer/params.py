"""`kv_transfer_params`, typed: what a request asks of the KV connector and where its prompt's KV
lies. Parsed once, at the API edge, from the client's JSON; carried on the request to the core
as msgspec structs; written back as JSON in a prefill engine's answer. Torch-free, so the API
server, the router and the operator can import it.

The JSON keys are vLLM's (`do_remote_decode`, `remote_engine_id`, ...): a vLLM client or proxy
speaks to Baton's engines unchanged. They are named here (`_JSON`) and nowhere else. Baton adds
three: the prompt's hash, and the key id and signature under which the prefill engine issued
the lease (``keyring.py``); a decode engine takes no lease without them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

from baton.kv_transfer.fingerprint import Fingerprint
from baton.kv_transfer.keyring import KeyRing, prompt_hash
from baton.roles import Role

FAILURE_POLICIES = ("recompute", "fail")
DO_REMOTE_DECODE = "do_remote_decode"  # prefill: compute the prompt, lease its KV, answer where
DO_REMOTE_PREFILL = "do_remote_prefill"  # decode: pull the prompt's KV from where it says

_Port = Annotated[int, msgspec.Meta(gt=0, lt=65536)]
_BlockId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]  # TCP sends block ids as 32-bit


class _JSON(msgspec.Struct, omit_defaults=True):
    """The JSON form, key by key, as vLLM names the keys; msgspec checks each value's type and
    range (a missing key or a null is None)."""

    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    kv_load_failure_policy: Literal["recompute", "fail"] | None = None
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: _Port | None = None
    remote_ports: Annotated[list[_Port], msgspec.Meta(min_length=1)] | None = None  # per rank
    remote_request_id: str | None = None
    remote_block_ids: list[_BlockId] | None = None
    num_prompt_tokens: Annotated[int, msgspec.Meta(ge=0, lt=2**31)] | None = None
    lease_expires_at: float | None = None  # Unix time, seconds
    prompt_hash: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    key_id: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    signature: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    fingerprint: Fingerprint | None = None  # the prefill engine's (fingerprint.py)


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks that `a` tokens fill, `b` to a block."""
    return -(-a // b)


class RemotePrefill(msgspec.Struct, frozen=True):
    """Where a decode request's prompt KV lies: a prefill engine's lease."""

    engine_id: str  # new at every start of the prefill engine: a restart is never mistaken
    host: str
    port: int  # where the shard this reader reads is served (rank 0's in the params)
    request_id: str  # the lease's name on the prefill engine
    block_ids: list[int]
    num_prompt_tokens: int
    lease_expires_at: float  # Unix time, seconds
    # One per tensor-parallel rank of the prefill engine: rank r's shard is served on ports[r].
    ports: tuple[int, ...] = ()
    prompt_hash: str = ""  # keyring.prompt_hash of the prompt's token ids
    fingerprint: Fingerprint = Fingerprint()  # the prefill engine's (none: the empty one)
    key_id: str = ""  # the key that signed it; readers authenticate to the KV server with it
    signature: str = ""

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.ports) or 1

    def for_rank(self, rank: int) -> RemotePrefill:
        """Where rank `rank`'s shard lies: the matching rank of the prefill engine."""
        return msgspec.structs.replace(self, port=self.ports[rank]) if self.ports else self

    def _message(self) -> bytes:
        """What the signature covers: every field a decode engine acts on."""
        return msgspec.msgpack.encode(
            [
                self.engine_id,
                self.host,
                self.port,
                list(self.ports),
                self.request_id,
                self.block_ids,
                self.num_prompt_tokens,
                self.prompt_hash,
                self.lease_expires_at,
                msgspec.structs.astuple(self.fingerprint),
            ]
        )

    def signed(self, keys: KeyRing, prompt_token_ids: list[int]) -> RemotePrefill:
        """These params for `prompt_token_ids`, signed with the ring's signing key."""
        out = msgspec.structs.replace(self, prompt_hash=prompt_hash(prompt_token_ids))
        kid, signature = keys.sign(out._message())
        return msgspec.structs.replace(out, key_id=kid, signature=signature)

    def unverified(self, keys: KeyRing) -> str | None:
        """Why a decode engine must not act on these params at all, or None. Whether they suit
        its model and prompt is the connector's check (a mismatch there follows the request's
        failure policy)."""
        if not (self.signature and self.key_id):
            return (
                "kv_transfer_params are not signed: pass a prefill engine's kv_transfer_params "
                "on unchanged (key_id and signature are missing)"
            )
        if not keys.has(self.key_id):
            return (
                f"kv_transfer_params are signed with key {self.key_id!r}, which this engine does "
                "not hold: another service issued them, or that key was rotated out"
            )
        if not keys.verify(self.key_id, self.signature, self._message()):
            return (
                "kv_transfer_params do not match their signature: they were changed after the "
                "prefill engine issued them"
            )
        return None


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """A request's instructions to the KV connector."""

    do_remote_decode: bool = False
    remote: RemotePrefill | None = None  # set: do_remote_prefill, from there
    load_failure_policy: str | None = None  # None: the engine's --kv-load-failure-policy
    # The client's request id (`baton.tracing`), set by the API server, never read from or
    # written to JSON: a prefill engine's lease keeps it, so that the lease's log lines name it.
    client_request_id: str | None = None

    @property
    def do_remote_prefill(self) -> bool:
        return self.remote is not None

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> KVTransferParams | None:
        """The client's `kv_transfer_params`, checked; None when they ask for nothing. Raises
        ValueError naming the field; keys Baton does not use are ignored, as vLLM ignores
        them (but must still hold values that fit 64 bits)."""
        if not params:
            return None
        try:
            msgspec.msgpack.encode(params)
            js = msgspec.convert(params, _JSON)
        except (OverflowError, RecursionError, TypeError) as e:
            raise ValueError(f"kv_transfer_params hold a value out of range: {e}") from None
        except msgspec.ValidationError as e:
            raise ValueError(f"kv_transfer_params: {e}") from None
        if js.do_remote_decode and js.do_remote_prefill:
            raise ValueError(
                f"kv_transfer_params cannot ask for both {DO_REMOTE_DECODE} and {DO_REMOTE_PREFILL}"
            )
        if not (js.do_remote_decode or js.do_remote_prefill or js.kv_load_failure_policy):
            return None
        return cls(
            do_remote_decode=bool(js.do_remote_decode),
            remote=_remote(js) if js.do_remote_prefill else None,
            load_failure_policy=js.kv_load_failure_policy,
        )

    @classmethod
    def lease(cls, remote: RemotePrefill) -> KVTransferParams:
        """A prefill engine's answer: the decode engine pulls from `remote`."""
        return cls(remote=remote)

    def to_json(self) -> dict[str, Any]:
        """The JSON form, as a client sends it back to a decode engine."""
        js = _JSON(
            do_remote_decode=self.do_remote_decode,
            do_remote_prefill=self.do_remote_prefill,
            kv_load_failure_policy=self.load_failure_policy,  # type: ignore[arg-type]
        )
        r = self.remote
        if r is not None:
            js.remote_engine_id, js.remote_host, js.remote_port = r.engine_id, r.host, r.port
            js.remote_ports, js.remote_request_id = list(r.ports or (r.port,)), r.request_id
            js.remote_block_ids, js.num_prompt_tokens = list(r.block_ids), r.num_prompt_tokens
            js.lease_expires_at = r.lease_expires_at
            js.prompt_hash, js.key_id, js.signature = r.prompt_hash, r.key_id, r.signature
            js.fingerprint = r.fingerprint
        out: dict[str, Any] = msgspec.to_builtins(js)
        return out

    def check_engine(self, role: Role | None, tensor_parallel_size: int) -> None:
        """Raises ValueError when an engine of `role` (None: no KV connector) cannot serve these
        params: the API server's check before it accepts the request."""
        for asked, key, serving_role in (
            (self.do_remote_decode, DO_REMOTE_DECODE, "prefill"),
            (self.do_remote_prefill, DO_REMOTE_PREFILL, "decode"),
        ):
            if asked and role not in (serving_role, "both"):
                raise ValueError(
                    f"{key} needs an engine of role {serving_role} or both; this engine's role "
                    f"is {role or 'both, without a KV transport'}"
                )
        mismatch = layout_mismatch(self.remote, tensor_parallel_size) if self.remote else None
        if mismatch is not None:
            raise ValueError(mismatch.split(": ", 1)[1])


def layout_mismatch(remote: RemotePrefill, tensor_parallel_size: int) -> str | None:
    """Why this engine cannot read `remote`'s blocks, or None. Each rank reads the shard of the
    matching remote rank, so both engines must split the KV heads alike."""
    if remote.tensor_parallel_size == tensor_parallel_size:
        return None
    return (
        f"INCOMPATIBLE_LAYOUT: the prefill engine runs tensor_parallel_size "
        f"{remote.tensor_parallel_size} (kv_transfer_params.remote_ports has "
        f"{remote.tensor_parallel_size}), this decode engine {tensor_parallel_size}; KV blocks "
        f"move only between engines of equal tensor_parallel_size"
    )


def _remote(js: _JSON) -> RemotePrefill:
    """A `do_remote_prefill` request's lease, every key of it present and coherent."""
    missing = [name for name in _REMOTE_KEYS if getattr(js, name) is None]
    if missing:
        raise ValueError(
            f"kv_transfer_params.{missing[0]} is missing, needed with {DO_REMOTE_PREFILL}"
        )
    assert js.remote_port is not None and js.lease_expires_at is not None
    ports = tuple(js.remote_ports or (js.remote_port,))
    if ports[0] != js.remote_port:
        raise ValueError(
            f"kv_transfer_params.remote_ports[0] ({ports[0]}) must be remote_port "
            f"({js.remote_port}): rank 0's shard is served on remote_port"
        )
    if not math.isfinite(js.lease_expires_at):
        raise ValueError("kv_transfer_params.lease_expires_at must be a finite number")
    return RemotePrefill(
        engine_id=str(js.remote_engine_id),
        host=str(js.remote_host),
        port=js.remote_port,
        request_id=str(js.remote_request_id),
        block_ids=list(js.remote_block_ids or ()),
        num_prompt_tokens=int(js.num_prompt_tokens or 0),
        lease_expires_at=js.lease_expires_at,
        ports=ports,
        prompt_hash=js.prompt_hash or "",
        key_id=js.key_id or "",
        signature=js.signature or "",
        fingerprint=js.fingerprint or Fingerprint(),
    )


_REMOTE_KEYS = (
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "remote_block_ids",
    "num_prompt_tokens",
    "lease_expires_at",
)
