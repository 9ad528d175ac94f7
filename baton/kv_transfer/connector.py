"""The pull connector, Baton's one `KVConnectorBase`, over a TCP or NIXL transport (the worker
half's choice: `choose_transport`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

from baton.kv_transfer.base import (
    ConnectorRequest,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    KVTransport,
    LeaseSpec,
    LoadSpec,
    TransferResult,
)
from baton.kv_transfer.fingerprint import Fingerprint, describe_mismatch
from baton.kv_transfer.keyring import KeyRing, prompt_hash
from baton.kv_transfer.params import KVTransferParams, RemotePrefill, cdiv, layout_mismatch

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Concurrent pulls per engine: each mostly waits on a socket, so a few threads keep the link busy
# without crowding the busy loop off the two cores of a small machine.
_LOADER_THREADS = 4
_RELEASE_TIMEOUT_S = 2.0


# The memory the NIXL transport registers, by the KV cache's device type (nixl/transport.py).
NIXL_MEMORY = {"cpu": "DRAM", "cuda": "VRAM"}
NIXL_INSTALL = "pip install 'baton[nixl]' (the nixl extra)"


class TransportUnavailableError(ValueError):
    """The transport the config names cannot serve this engine: a bad config, so the engine
    does not start."""


def nixl_import_error() -> str | None:
    """Why the NIXL transport cannot be imported here (None: it can)."""
    try:
        import baton.kv_transfer.nixl.transport  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def _unavailable(problem: str) -> TransportUnavailableError:
    return TransportUnavailableError(
        f"--kv-transport nixl: {problem}. Install NIXL with {NIXL_INSTALL}, or use "
        "--kv-transport tcp (or auto, which takes NIXL only where it works)"
    )


def choose_transport(transport: str, device_type: str) -> tuple[str, str]:
    """The transport an engine whose KV cache lives on `device_type` uses for `transport`
    (auto, tcp or nixl), and why. An explicit nixl that cannot serve raises
    `TransportUnavailableError`: it never becomes TCP behind the user's back."""
    if transport == "tcp":
        return "tcp", "--kv-transport tcp"
    memory = NIXL_MEMORY.get(device_type)
    problem: str | None
    if memory is None:
        problem = (
            f"the NIXL transport registers host (DRAM) or CUDA (VRAM) memory, and this "
            f"KV cache is on {device_type}"
        )
    else:
        error = nixl_import_error()
        problem = None if error is None else f"NIXL cannot be imported ({error})"
    if transport == "nixl":
        if problem is not None:
            raise _unavailable(problem)
        return "nixl", f"--kv-transport nixl, {memory} memory"
    if transport != "auto":
        raise ValueError(f"unknown kv transport {transport!r}")
    if problem is None:
        return "nixl", f"auto: NIXL imports and registers {memory} memory"
    return "tcp", f"auto: {problem}"


def make_transport(
    config: KVTransferConfig, keys: KeyRing, device_type: str = "cpu"
) -> KVTransport:
    """The transport `choose_transport` picks for a KV cache on `device_type`; logs which and
    why."""
    name, why = choose_transport(config.transport, device_type)
    logger.info("KV transport %s (%s)", name, why)
    if name == "nixl":
        from baton.kv_transfer.nixl.transport import NixlTransport

        return NixlTransport(config, keys)
    from baton.kv_transfer.tcp.transport import TCPTransport

    return TCPTransport(config, keys)


class PullConnector(KVConnectorBase):
    """Leases on the prefill side, background pulls on the decode side."""

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        block_size: int,
        ports: list[int] | None = None,
        fingerprint: Fingerprint | None = None,
    ) -> None:
        super().__init__(config, role)
        # This engine's; what a decode request's params carry must equal it (None: the worker
        # half, which compares nothing).
        self.fingerprint = fingerprint or Fingerprint()
        self.block_size = block_size
        # Signs the leases this engine hands out; its transport authenticates peers with it.
        self.keys = KeyRing.load(config.secret_file)
        # Where each rank's shard is served: the scheduler half is told by the worker half, whose
        # transports pick the ports when they start (`register_kv_cache`).
        self.ports: list[int] = ports or [config.port]
        # ---- scheduler half
        self._meta = KVConnectorMetadata()
        # The request `_remote` checked last and what it found: the scheduler asks twice for
        # each request (matched tokens, then after allocating), and at every step while its
        # blocks do not fit; the check hashes the whole prompt (73 µs at 2,000 tokens).
        self._checked: tuple[ConnectorRequest, RemotePrefill | str | None] | None = None
        # ---- worker half
        self.transport: KVTransport | None = None  # made by register_kv_cache
        self.wake: Callable[[], None] | None = None  # called when a pull ends (wakes the loop)
        self._lock = threading.Lock()
        self._done: list[TransferResult] = []
        self._num_loading = 0
        self._num_leases = 0
        self._pool: ThreadPoolExecutor | None = None

    # ======================== scheduler half ========================

    def _remote(self, request: ConnectorRequest) -> RemotePrefill | str | None:
        """The remote prompt KV of a decode request (None: it asks for none), or why this
        engine cannot read it (a failure code and message)."""
        if self._checked is not None and self._checked[0] is request:
            return self._checked[1]
        found = self._check(request)
        self._checked = (request, found)
        return found

    def _check(self, request: ConnectorRequest) -> RemotePrefill | str | None:
        params = request.kv_transfer_params
        remote = params.remote if params is not None else None
        if remote is None:
            return None
        num_prompt = request.num_prompt_tokens
        if remote.num_prompt_tokens != num_prompt or len(remote.block_ids) < cdiv(
            num_prompt - 1, self.block_size
        ):
            return (
                f"BAD_PARAMS: kv_transfer_params do not describe this prompt ({num_prompt} tokens)"
            )
        # Both sides computed the same KV only with the same model, dtype, layout and tokens.
        mismatch = layout_mismatch(remote, len(self.ports)) or describe_mismatch(
            remote.fingerprint, self.fingerprint
        )
        if mismatch is not None:
            return mismatch
        if remote.prompt_hash != prompt_hash(request.prompt_token_ids):
            return (
                "INCOMPATIBLE: prompt differs: the prefill engine computed other token ids for "
                "this request (another tokenizer or chat template?)"
            )
        return remote

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int:
        if not isinstance(self._remote(request), RemotePrefill):
            return 0
        # The last prompt token is recomputed here: its logits give the first token.
        return max(0, request.num_prompt_tokens - 1 - num_computed_tokens)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external: int
    ) -> TransferResult | None:
        remote = self._remote(request)
        if remote is None:
            return None
        if isinstance(remote, str):
            # Signed, so the lease is real: free its blocks now rather than at expiry (unless
            # its ranks do not match ours, when there is no matching rank to tell).
            params = request.kv_transfer_params
            lease = params.remote if params is not None else None
            if lease is not None and not remote.startswith("INCOMPATIBLE_LAYOUT"):
                self._meta.releases.append(lease)
            return TransferResult(request.request_id, False, remote)
        if num_external == 0:
            self._meta.releases.append(remote)
            return None
        # The remote tokens end one before the prompt's end (its last token is computed here).
        end = request.num_prompt_tokens - 1
        first, last = (end - num_external) // self.block_size, cdiv(end, self.block_size)
        self._meta.loads.append(
            LoadSpec(
                req_id=request.request_id,
                remote=remote,
                remote_block_ids=remote.block_ids[first:last],
                local_block_ids=block_ids[first:last],
                timeout=self.config.load_timeout,
            )
        )
        return None

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> KVTransferParams | None:
        params = request.kv_transfer_params
        if params is None or not params.do_remote_decode:
            return None
        num_prompt = request.num_prompt_tokens
        lease_ids = block_ids[: cdiv(num_prompt, self.block_size)]
        if not lease_ids:
            return None
        expires_at = time.time() + self.config.lease_seconds
        self._meta.leases.append(
            LeaseSpec(request.request_id, lease_ids, expires_at, params.client_request_id)
        )
        remote = RemotePrefill(
            engine_id=self.config.engine_id,
            host=self.config.public_host,
            port=self.ports[0],
            request_id=request.request_id,
            block_ids=lease_ids,
            num_prompt_tokens=num_prompt,
            lease_expires_at=expires_at,
            ports=tuple(self.ports),
            fingerprint=self.fingerprint,
        )
        return KVTransferParams.lease(remote.signed(self.keys, request.prompt_token_ids))

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    # ========================= worker half ==========================

    @property
    def transport_name(self) -> str:
        return self.transport.name if self.transport is not None else "none"

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.transport = make_transport(self.config, self.keys, kv_cache.device.type)
        self.ports = [self.transport.start(kv_cache)]
        self._pool = ThreadPoolExecutor(_LOADER_THREADS, thread_name_prefix="kv-load")
        logger.info(
            "KV connector: role %s, transport %s on %s:%d, rank %d",
            self.config.role,
            self.transport.name,
            self.config.public_host,
            self.ports[0],
            self.config.rank,
        )
        # The engine id is what a KV server checks a reader by: not for INFO logs.
        logger.debug("KV connector engine id %s", self.config.engine_id)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        transport, pool = self.transport, self._pool
        if transport is None or pool is None:
            raise RuntimeError("register_kv_cache first")
        for lease in metadata.leases:
            transport.lease(
                lease.req_id, lease.block_ids, lease.expires_at, lease.client_request_id
            )
            self._num_leases += 1
        rank = self.config.rank  # this rank reads the matching rank's shard
        for spec in metadata.loads:
            with self._lock:
                self._num_loading += 1
            pool.submit(self._pull, replace(spec, remote=spec.remote.for_rank(rank)))
        for remote in metadata.releases:
            deadline = time.monotonic() + _RELEASE_TIMEOUT_S
            pool.submit(transport.release_remote, remote.for_rank(rank), deadline)

    def _pull(self, spec: LoadSpec) -> None:
        assert self.transport is not None
        start = time.monotonic()
        try:
            result = self.transport.read(spec, start + spec.timeout)
        except Exception as exc:  # a transport bug must still end the pull
            logger.exception("KV pull for %s raised", spec.req_id)
            result = TransferResult(spec.req_id, False, f"INTERNAL: {exc}")
        if not result.ok:
            logger.warning("KV pull for %s failed: %s", spec.req_id, result.error)
            # The prefill side frees at once instead of at expiry; harmless if it is gone.
            self.transport.release_remote(spec.remote, time.monotonic() + _RELEASE_TIMEOUT_S)
        with self._lock:
            self._done.append(result)
            self._num_loading -= 1
        wake = self.wake
        if wake is not None:
            wake()

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            done, self._done = self._done, []
        claimed: list[str] = []
        expired: list[str] = []
        if self.transport is not None and self._num_leases:
            claimed, expired = self.transport.finished_leases(time.time())
            self._num_leases -= len(claimed) + len(expired)
        return KVConnectorOutput(done, claimed, expired)

    def has_pending(self) -> bool:
        return self._num_loading > 0 or bool(self._done) or self._num_leases > 0

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.transport is not None:
            self.transport.stop()
