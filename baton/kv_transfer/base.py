"""The KV connector contract: one abstract class with a scheduler half and a worker half, the
plain records that pass between them, and the transport interface that moves the bytes.

The flow (ARCHITECTURE.md, "The request's path"):

- prefill engine: a request with ``kv_transfer_params.do_remote_decode`` finishes; the scheduler
  half keeps its blocks (``request_finished`` says "delay the free") and puts a ``LeaseSpec`` in
  the step's metadata; the worker half offers those blocks to readers until a reader says DONE or
  the lease expires, and reports both in ``KVConnectorOutput``; the scheduler then frees them.
- decode engine: a request with ``do_remote_prefill`` asks ``get_num_new_matched_tokens`` how many
  prompt tokens can come from the remote engine; the scheduler allocates local blocks, calls
  ``update_state_after_alloc`` and parks the request in WAITING_FOR_REMOTE_KVS; the scheduler half
  puts a ``LoadSpec`` in the metadata; the worker half pulls in the background and reports the
  result; the scheduler continues the request (or applies its failure policy).
"""

from __future__ import annotations

import abc
import enum
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import msgspec

from baton.kv_transfer.params import FAILURE_POLICIES, KVTransferParams, RemotePrefill
from baton.roles import ROLES, Role

if TYPE_CHECKING:  # the contract names the tensor; importing it would load torch everywhere
    import torch

# auto: NIXL where it imports and serves the KV cache's memory, else TCP (connector.py).
TRANSPORTS = ("auto", "tcp", "nixl")
# TCP's staging through host buffers (tcp/staging.py): auto stages a KV cache outside host memory
# only; always stages a host cache too (CI runs the device path's logic on CPU that way).
STAGING_MODES = ("auto", "always")


class KVConnectorRole(enum.Enum):
    """Which half of the connector an instance serves."""

    SCHEDULER = "scheduler"  # in the busy loop, with the scheduler
    WORKER = "worker"  # next to the KV tensor


@dataclass(frozen=True)
class KVTransferConfig:
    """The engine's KV-transfer settings (flags ``--role``, ``--kv-*``)."""

    role: Role = "both"
    transport: str = "auto"
    host: str = "127.0.0.1"  # where the block server listens
    port: int = 0  # 0: a free port
    advertise_host: str | None = None  # what readers connect to; default: host
    lease_seconds: float = 30.0
    load_timeout: float = 10.0  # a pull not done by then has failed
    load_failure_policy: str = "recompute"
    rank: int = 0  # the tensor-parallel rank whose KV shard this worker half serves
    # The hand-off secrets (keyring.py); None: $BATON_KV_SECRET, else the user's own file.
    secret_file: str | None = None
    staging: str = "auto"  # STAGING_MODES: when TCP stages blocks through host buffers
    # New at every engine start, so that a reader never mistakes a restarted engine's memory
    # for the one it was told about.
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.staging not in STAGING_MODES:
            raise ValueError(f"kv staging must be one of {STAGING_MODES}, got {self.staging!r}")
        if self.load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {FAILURE_POLICIES}, "
                f"got {self.load_failure_policy!r}"
            )
        if not self.lease_seconds > 0:
            raise ValueError(f"kv lease seconds must be > 0, got {self.lease_seconds}")
        if not self.load_timeout > 0:
            raise ValueError(f"kv load timeout must be > 0, got {self.load_timeout}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"kv port must be in [0, 65536), got {self.port}")

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    def for_rank(self, rank: int) -> KVTransferConfig:
        """The config of rank `rank`'s worker half: a fixed port becomes `port + rank`, so
        that every rank of a pod serves its shard on a known port."""
        return replace(self, rank=rank, port=self.port + rank if self.port else 0)


# ---- what passes from the scheduler half to the worker half --------------------------------


@dataclass(frozen=True)
class LoadSpec:
    """Pull ``remote_block_ids`` of a remote engine into ``local_block_ids`` (same order)."""

    req_id: str
    remote: RemotePrefill
    remote_block_ids: list[int]
    local_block_ids: list[int]
    timeout: float  # seconds from when the worker starts the pull


@dataclass(frozen=True)
class LeaseSpec:
    """Offer ``block_ids`` to remote readers under ``req_id`` until ``expires_at`` (Unix time)."""

    req_id: str
    block_ids: list[int]
    expires_at: float
    client_request_id: str | None = None  # for the lease's log lines (`baton.tracing`)


@dataclass
class KVConnectorMetadata:
    """The scheduler half's instructions for one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    leases: list[LeaseSpec] = field(default_factory=list)
    # Remote leases this engine will not read (its prefix cache already held the prompt): the
    # worker tells the prefill engine, so that it frees the blocks now instead of at expiry.
    releases: list[RemotePrefill] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.leases or self.releases)


# ---- what passes back ------------------------------------------------------------------------


class TransferResult(msgspec.Struct, frozen=True, array_like=True):
    """How one pull ended. ``reason`` is a short code for metrics (``UNKNOWN_ENGINE``,
    ``EXPIRED``, ``CHECKSUM_MISMATCH``, ``DEADLINE``, ``CONNECT_FAILED`` ...), ``error`` the
    whole message. It travels as it is to the API server, whose metrics count it."""

    req_id: str
    ok: bool
    error: str | None = None
    num_bytes: int = 0
    seconds: float = 0.0

    @property
    def reason(self) -> str:
        if self.ok or not self.error:
            return ""
        return self.error.split(":", 1)[0]


@dataclass
class KVConnectorOutput:
    """What the worker half reports after a step: pulls that ended, leases that ended."""

    finished_loads: list[TransferResult] = field(default_factory=list)
    claimed_leases: list[str] = field(default_factory=list)  # a reader finished (or released)
    expired_leases: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.finished_loads or self.claimed_leases or self.expired_leases)


# ---- transports ------------------------------------------------------------------------------


class KVTransport(Protocol):
    """Moves blocks of one engine's KV tensor ``[num_blocks, ...]`` to and from peers.

    Serving side (prefill): ``lease``/``finished_leases`` are called from the busy loop and must
    not block. Reading side (decode): ``read`` and ``release_remote`` block and are called on the
    connector's loader threads; they return failures as results and never raise.
    """

    name: str

    def start(self, kv_cache: torch.Tensor) -> int:
        """Registers the KV tensor, starts serving, returns the port readers connect to."""
        ...

    def lease(
        self,
        req_id: str,
        block_ids: list[int],
        expires_at: float,
        client_request_id: str | None = None,
    ) -> None: ...

    def finished_leases(self, now: float) -> tuple[list[str], list[str]]:
        """(claimed since the last call, expired now); both are gone from the transport."""
        ...

    def read(self, spec: LoadSpec, deadline: float) -> TransferResult:
        """Pulls ``spec`` into the local tensor by ``deadline`` (``time.monotonic()``)."""
        ...

    def release_remote(self, remote: RemotePrefill, deadline: float) -> None:
        """Tells the prefill engine to drop a lease this engine will not read (best effort)."""
        ...

    def stop(self) -> None: ...


# ---- the connector ---------------------------------------------------------------------------


class ConnectorRequest(Protocol):
    """What the connector reads of an engine request (the engine's `Request` has it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def kv_transfer_params(self) -> KVTransferParams | None: ...


class KVConnectorBase(abc.ABC):
    """One class, two halves; an instance serves the half its ``role`` names.

    Scheduler-half methods are called from the busy loop only, must not block and do no I/O;
    what they decide comes back as their return values. Worker-half methods are called from the
    busy loop too, but own the transport's threads, where everything that blocks runs, bounded by
    deadlines; what ended comes back from `get_finished`.
    """

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        self.config = config
        self.role = role

    # ======================== scheduler half ========================

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int:
        """Prompt tokens after the ``num_computed_tokens`` local hits that can be loaded from a
        remote engine (0: none). Side-effect free; called each time the request is considered."""

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external: int
    ) -> TransferResult | None:
        """Called once per request that asked for a remote prefill, after the scheduler
        allocated its local blocks (``block_ids``, all of them) for the ``num_external`` remote
        tokens that `get_num_new_matched_tokens` offered (0: nothing will be loaded; the remote
        lease may be released). Returns a failed result when the request's params cannot be used
        at all (the request is then computed locally and the result counted)."""

    @abc.abstractmethod
    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> KVTransferParams | None:
        """Called once when a request finishes. Returns the params for the client when the
        blocks are kept for a remote reader: the scheduler then must not free them until the
        worker half reports the lease claimed or expired. None: free them now."""

    @abc.abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """The instructions gathered since the last call, for the worker half; resets them."""

    def load_failure_policy(self, request: ConnectorRequest) -> str:
        """What a failed pull of ``request`` does: "recompute" locally or "fail" the request.
        The request's own choice, else the engine's."""
        params = request.kv_transfer_params
        if params is not None and params.load_failure_policy is not None:
            return params.load_failure_policy
        return self.config.load_failure_policy

    # ========================= worker half ==========================

    @abc.abstractmethod
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Called once, after the KV tensor is allocated and before the first step."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Starts the step's pulls and leases; must not block (pulls run in the background)."""

    @abc.abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Pulls and leases that ended since the last call. Must not block."""

    def has_pending(self) -> bool:
        """Whether a pull or a lease is outstanding (the busy loop then keeps polling)."""
        return False

    def shutdown(self) -> None:  # noqa: B027 - an optional hook
        """Stops the transport's threads; pulls in progress fail."""


class KVWorkerHalf(Protocol):
    """The worker half as the busy loop drives it: a `KVConnectorBase` worker in this process
    (tensor_parallel_size 1), or one per rank in the worker processes behind one proxy."""

    wake: Callable[[], None] | None  # called from another thread when something ended

    @property
    def transport_name(self) -> str: ...

    @property
    def ports(self) -> list[int]:
        """One per rank: where that rank's shard is served."""
        ...

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None: ...

    def get_finished(self) -> KVConnectorOutput: ...

    def has_pending(self) -> bool: ...

    def shutdown(self) -> None: ...
