"""`kv_transfer_params`, typed: what a request asks of the KV connector and where its prompt's KV
lies. Parsed once, at the API edge, from the client's JSON; carried on the request to the core
as msgspec structs; written back as JSON in a prefill engine's answer. Torch-free, so the API
server, the router and the operator can import it.

The JSON keys are vLLM's (`do_remote_decode`, `remote_engine_id`, ...): a vLLM client or proxy
speaks to Baton's engines unchanged. They are named here and nowhere else.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from baton.roles import Role

FAILURE_POLICIES = ("recompute", "fail")

# ---- the JSON keys ---------------------------------------------------------------------------

DO_REMOTE_DECODE = "do_remote_decode"  # prefill: compute the prompt, lease its KV, answer where
DO_REMOTE_PREFILL = "do_remote_prefill"  # decode: pull the prompt's KV from where it says
FAILURE_POLICY = "kv_load_failure_policy"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_PORTS = "remote_ports"  # one per tensor-parallel rank; [0] is REMOTE_PORT
REMOTE_REQUEST_ID = "remote_request_id"
REMOTE_BLOCK_IDS = "remote_block_ids"
NUM_PROMPT_TOKENS = "num_prompt_tokens"
LEASE_EXPIRES_AT = "lease_expires_at"

_MAX_BLOCK_ID = 2**32  # the TCP transport sends block ids as 32-bit integers
_MAX_TOKENS = 2**31


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

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.ports) or 1

    def for_rank(self, rank: int) -> RemotePrefill:
        """Where rank `rank`'s shard lies: the matching rank of the prefill engine."""
        return msgspec.structs.replace(self, port=self.ports[rank]) if self.ports else self


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """A request's instructions to the KV connector."""

    do_remote_decode: bool = False
    remote: RemotePrefill | None = None  # set: do_remote_prefill, from there
    load_failure_policy: str | None = None  # None: the engine's --kv-load-failure-policy

    @property
    def do_remote_prefill(self) -> bool:
        return self.remote is not None

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> KVTransferParams | None:
        """The client's `kv_transfer_params`, checked; None when there are none. Raises
        ValueError naming the field; other keys are ignored, as vLLM ignores them."""
        if not params:
            return None
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be an object")
        try:  # keys Baton does not use are ignored, but must still be sane JSON values
            msgspec.msgpack.encode(params)
        except (OverflowError, RecursionError, TypeError) as e:
            raise ValueError(f"kv_transfer_params hold a value out of range: {e}") from None
        remote_decode = params.get(DO_REMOTE_DECODE) is True
        remote_prefill = params.get(DO_REMOTE_PREFILL) is True
        if remote_decode and remote_prefill:
            raise ValueError(
                f"kv_transfer_params cannot ask for both {DO_REMOTE_DECODE} and {DO_REMOTE_PREFILL}"
            )
        policy = params.get(FAILURE_POLICY)
        if policy is not None and policy not in FAILURE_POLICIES:
            raise ValueError(
                f"kv_transfer_params.{FAILURE_POLICY} must be one of {FAILURE_POLICIES}, "
                f"got {policy!r}"
            )
        if not (remote_decode or remote_prefill or policy):
            return None
        return cls(
            do_remote_decode=remote_decode,
            remote=_parse_remote(params) if remote_prefill else None,
            load_failure_policy=policy,
        )

    @classmethod
    def lease(cls, remote: RemotePrefill) -> KVTransferParams:
        """A prefill engine's answer: the decode engine pulls from `remote`."""
        return cls(remote=remote)

    def to_json(self) -> dict[str, Any]:
        """The JSON form, as a client sends it back to a decode engine."""
        out: dict[str, Any] = {
            DO_REMOTE_DECODE: self.do_remote_decode,
            DO_REMOTE_PREFILL: self.do_remote_prefill,
        }
        if self.load_failure_policy is not None:
            out[FAILURE_POLICY] = self.load_failure_policy
        r = self.remote
        if r is not None:
            out.update(
                {
                    REMOTE_ENGINE_ID: r.engine_id,
                    REMOTE_HOST: r.host,
                    REMOTE_PORT: r.port,
                    REMOTE_PORTS: list(r.ports or (r.port,)),
                    REMOTE_REQUEST_ID: r.request_id,
                    REMOTE_BLOCK_IDS: list(r.block_ids),
                    NUM_PROMPT_TOKENS: r.num_prompt_tokens,
                    LEASE_EXPIRES_AT: r.lease_expires_at,
                }
            )
        return out

    def check_engine(self, role: Role | None, tensor_parallel_size: int) -> None:
        """Raises ValueError when an engine of `role` (None: no KV connector) cannot serve these
        params: the API server's check before it accepts the request."""
        if self.do_remote_decode and role not in ("prefill", "both"):
            raise ValueError(
                f"{DO_REMOTE_DECODE} needs an engine of role prefill or both; this engine's role "
                f"is {role or 'both, without a KV transport'}"
            )
        if self.remote is None:
            return
        if role not in ("decode", "both"):
            raise ValueError(
                f"{DO_REMOTE_PREFILL} needs an engine of role decode or both; this engine's role "
                f"is {role or 'both, without a KV transport'}"
            )
        mismatch = layout_mismatch(self.remote, tensor_parallel_size)
        if mismatch is not None:
            raise ValueError(mismatch.split(": ", 1)[1])


def layout_mismatch(remote: RemotePrefill, tensor_parallel_size: int) -> str | None:
    """Why this engine cannot read `remote`'s blocks, or None. Each rank reads the shard of the
    matching remote rank, so both engines must split the KV heads alike."""
    if remote.tensor_parallel_size == tensor_parallel_size:
        return None
    return (
        f"INCOMPATIBLE_LAYOUT: the prefill engine runs tensor_parallel_size "
        f"{remote.tensor_parallel_size} (kv_transfer_params.{REMOTE_PORTS} has "
        f"{remote.tensor_parallel_size}), this decode engine {tensor_parallel_size}; KV blocks "
        f"move only between engines of equal tensor_parallel_size"
    )


# ---- parsing ---------------------------------------------------------------------------------


def _field(params: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = params.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        names = " or ".join(k.__name__ for k in kinds)
        raise ValueError(f"kv_transfer_params.{name} is missing or not a {names}")
    return value


def _int(params: dict[str, Any], name: str, low: int, high: int) -> int:
    value = _field(params, name, int)
    if not low <= value < high:
        raise ValueError(f"kv_transfer_params.{name} {value} is not in [{low}, {high})")
    return int(value)


def _port(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
        raise ValueError(f"kv_transfer_params.{name} {value!r} is not a TCP port")
    return value


def _parse_remote(params: dict[str, Any]) -> RemotePrefill:
    block_ids = _field(params, REMOTE_BLOCK_IDS, list)
    if not all(
        isinstance(b, int) and not isinstance(b, bool) and 0 <= b < _MAX_BLOCK_ID for b in block_ids
    ):
        raise ValueError(
            f"kv_transfer_params.{REMOTE_BLOCK_IDS} must be integers in [0, {_MAX_BLOCK_ID})"
        )
    port = _port(_field(params, REMOTE_PORT, int), REMOTE_PORT)
    ports = params.get(REMOTE_PORTS, [port])
    if not isinstance(ports, list) or not ports:
        raise ValueError(f"kv_transfer_params.{REMOTE_PORTS} must be a non-empty list of ports")
    ports = tuple(_port(p, f"{REMOTE_PORTS}[]") for p in ports)
    if ports[0] != port:
        raise ValueError(
            f"kv_transfer_params.{REMOTE_PORTS}[0] ({ports[0]}) must be {REMOTE_PORT} ({port}): "
            f"rank 0's shard is served on {REMOTE_PORT}"
        )
    expires = float(_field(params, LEASE_EXPIRES_AT, (int, float)))
    if not math.isfinite(expires):
        raise ValueError(f"kv_transfer_params.{LEASE_EXPIRES_AT} must be a finite number")
    return RemotePrefill(
        engine_id=_field(params, REMOTE_ENGINE_ID, str),
        host=_field(params, REMOTE_HOST, str),
        port=port,
        request_id=_field(params, REMOTE_REQUEST_ID, str),
        block_ids=[int(b) for b in block_ids],
        num_prompt_tokens=_int(params, NUM_PROMPT_TOKENS, 0, _MAX_TOKENS),
        lease_expires_at=expires,
        ports=ports,
    )
