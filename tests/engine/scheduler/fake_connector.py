"""A KV connector without sockets: both halves in memory, with the test deciding when each pull
ends (and how) and when each lease is claimed or expires. It keeps the contract of
`KVConnectorBase`, so the scheduler cannot tell it from the real one."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.kv_transfer.base import (
    ConnectorRequest,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    LeaseSpec,
    LoadSpec,
    TransferResult,
)
from baton.kv_transfer.params import KVTransferParams, RemotePrefill, cdiv


@dataclass
class FakeConnector(KVConnectorBase):
    block_size: int = 4
    policy: str = "recompute"
    loads: dict[str, LoadSpec] = field(default_factory=dict)  # started, not yet ended
    leases: dict[str, LeaseSpec] = field(default_factory=dict)
    releases: list[str] = field(default_factory=list)  # remote leases this engine will not read
    _meta: KVConnectorMetadata = field(default_factory=KVConnectorMetadata)
    _out: KVConnectorOutput = field(default_factory=KVConnectorOutput)

    def __post_init__(self) -> None:
        super().__init__(
            KVTransferConfig(role="both", load_failure_policy=self.policy),
            KVConnectorRole.SCHEDULER,
        )

    # ---- scheduler half (the contract) --------------------------------------------------------

    def _usable(self, request: ConnectorRequest) -> RemotePrefill | None:
        params = request.kv_transfer_params
        remote = params.remote if params is not None else None
        if remote is None or remote.num_prompt_tokens != request.num_prompt_tokens:
            return None
        return remote

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int:
        if self._usable(request) is None:
            return 0
        return max(0, request.num_prompt_tokens - 1 - num_computed_tokens)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external: int
    ) -> TransferResult | None:
        params = request.kv_transfer_params
        if params is None or params.remote is None:
            return None
        remote = self._usable(request)
        if remote is None:
            return TransferResult(request.request_id, False, "BAD_PARAMS: not this prompt")
        if num_external == 0:
            self._meta.releases.append(remote)
            return None
        end = request.num_prompt_tokens - 1
        first, last = (end - num_external) // self.block_size, cdiv(end, self.block_size)
        spec = LoadSpec(
            request.request_id, remote, remote.block_ids[first:last], block_ids[first:last], 1.0
        )
        self._meta.loads.append(spec)
        return None

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int]
    ) -> KVTransferParams | None:
        params = request.kv_transfer_params
        if params is None or not params.do_remote_decode:
            return None
        lease_ids = block_ids[: cdiv(request.num_prompt_tokens, self.block_size)]
        self._meta.leases.append(LeaseSpec(request.request_id, lease_ids, 1e12))
        return KVTransferParams.lease(
            RemotePrefill(
                "fake",
                "127.0.0.1",
                1,
                request.request_id,
                lease_ids,
                request.num_prompt_tokens,
                1e12,
            )
        )

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    # ---- worker half, in memory -----------------------------------------------------------------

    def register_kv_cache(self, kv_cache: object) -> None:
        pass

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        self.loads.update((spec.req_id, spec) for spec in metadata.loads)
        self.leases.update((lease.req_id, lease) for lease in metadata.leases)
        self.releases += [remote.request_id for remote in metadata.releases]

    def get_finished(self) -> KVConnectorOutput:
        out, self._out = self._out, KVConnectorOutput()
        return out

    def has_pending(self) -> bool:
        return bool(self.loads or self.leases or self._out)

    # ---- what the test decides ------------------------------------------------------------------

    def end_load(self, req_id: str, error: str | None = None) -> None:
        spec = self.loads.pop(req_id)
        num_bytes = 0 if error else 100 * len(spec.local_block_ids)
        self._out.finished_loads.append(TransferResult(req_id, error is None, error, num_bytes))

    def claim(self, req_id: str) -> None:
        del self.leases[req_id]
        self._out.claimed_leases.append(req_id)

    def expire(self, req_id: str) -> None:
        del self.leases[req_id]
        self._out.expired_leases.append(req_id)

    def sync(self) -> None:
        """The worker half takes the step's instructions (the engine does this every step)."""
        self.start_load_kv(self.build_connector_meta())
