"""The scheduler's side of disaggregated serving, one component the `Scheduler` holds: decode
requests parked while their prompt KV is pulled (WAITING_FOR_REMOTE_KVS), finished prefill
requests whose blocks are leased out, and aborted pulls whose blocks the loader may still write.

It talks to the connector's scheduler half only through `KVConnectorBase`, and tells the
scheduler what to do with a request through return values; the scheduler owns the queues.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from baton.engine.kv_cache.block_pool import KVCacheBlock
from baton.engine.kv_cache.manager import KVCacheManager
from baton.engine.request import Request, RequestStatus
from baton.kv_transfer.base import KVConnectorBase, KVConnectorOutput, TransferResult
from baton.kv_transfer.params import KVTransferParams
from baton.tracing import log_for

logger = logging.getLogger(__name__)


@dataclass
class KVUpdate:
    """What the pulls and leases that ended mean for the scheduler's queues."""

    resume: list[Request] = field(default_factory=list)  # back to the front of `waiting`
    failed: list[Request] = field(default_factory=list)  # ended with an error ("fail" policy)


class RemoteKV:
    """Remote-KV bookkeeping over a connector's scheduler half. Never blocks; no I/O."""

    def __init__(self, connector: KVConnectorBase, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        self.waiting_for_kvs: dict[str, Request] = {}  # pulls in flight (not in `waiting`)
        # Finished prefill requests whose blocks a decode engine may still read -> their number
        # of leased blocks (the requests are no longer in the scheduler's `requests`).
        self.leased: dict[str, tuple[Request, int]] = {}
        self._free_after_load: dict[str, Request] = {}  # aborted while their pull ran
        self._ended: list[TransferResult] = []  # pulls that ended, for the next stats
        # Requests whose params the connector refused under policy "fail": `update` ends them.
        self.refused: list[Request] = []
        self.num_leases_expired = 0

    # ---- requests in -----------------------------------------------------------------------

    def start_load(self, request: Request, hits: list[KVCacheBlock], num_hit: int) -> bool | None:
        """Allocates blocks for a decode request's remote prompt KV and parks it.

        True: parked in WAITING_FOR_REMOTE_KVS (the caller takes it off `waiting`); False:
        nothing to load, schedule it as usual; None: its blocks do not fit yet.
        """
        num_external = self.connector.get_num_new_matched_tokens(request, num_hit)
        if num_external > 0 and self.kv.allocate_slots(request, num_external, hits) is None:
            return None
        request.kv_load_tried = True
        block_ids = self.kv.block_ids(request.request_id) if num_external else []
        rejected = self.connector.update_state_after_alloc(request, block_ids, num_external)
        if rejected is not None:
            logger.warning("KV params of %s refused: %s", request.request_id, rejected.error)
            self._ended.append(rejected)
            if self.connector.load_failure_policy(request) == "fail":
                request.status = RequestStatus.FINISHED_ERROR
                request.error = f"KV cache from the prefill engine refused: {rejected.error}"
                self.refused.append(request)
                return True  # off `waiting`: the next `update` ends it
        if num_external == 0:
            return False
        request.num_computed_tokens = num_hit
        request.num_cached_tokens = num_hit
        request.first_scheduled_time = time.time()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_kvs[request.request_id] = request
        return True

    def request_finished(self, request: Request) -> KVTransferParams | None:
        """A finished request: its params for the client when its blocks stay leased."""
        params = self.connector.request_finished(request, self.kv.block_ids(request.request_id))
        if params is not None and params.remote is not None:
            self.leased[request.request_id] = (request, len(params.remote.block_ids))
        return params

    def abort(self, request: Request) -> None:
        """A parked request ended from outside: its blocks are freed once its pull reports,
        since the loader may still be writing into them."""
        del self.waiting_for_kvs[request.request_id]
        self._free_after_load[request.request_id] = request

    def holds_blocks(self, req_id: str) -> bool:
        """Whether a finished request's blocks are still in use here (leased or being written)."""
        return req_id in self.leased or req_id in self._free_after_load

    # ---- what the worker half reports --------------------------------------------------------

    def update(self, output: KVConnectorOutput) -> KVUpdate:
        """Continues requests whose pulls ended and frees blocks whose leases ended.

        A pulled request resumes with all but its last prompt token computed. A failed pull
        follows the request's failure policy: "recompute" starts it over locally (its pulled
        blocks are dropped, since their contents are unknown); "fail" ends it with an error.
        """
        update = KVUpdate(failed=self.refused)
        self.refused = []
        self._ended.extend(output.finished_loads)
        for result in output.finished_loads:
            aborted = self._free_after_load.pop(result.req_id, None)
            if aborted is not None:
                self.kv.free(aborted)
                continue
            request = self.waiting_for_kvs.pop(result.req_id, None)
            if request is None:
                continue
            if result.ok:
                request.num_computed_tokens = request.num_prompt_tokens - 1
                # The pull filled all but the local hit (num_cached_tokens, set at the start)
                # and the last prompt token, which this engine computes for its logits.
                request.num_external_tokens = request.num_computed_tokens - max(
                    request.num_cached_tokens, 0
                )
                self.kv.cache_blocks(request)
                request.status = RequestStatus.WAITING
                update.resume.append(request)
                continue
            logger.warning("KV load for %s failed: %s", result.req_id, result.error)
            if self.connector.load_failure_policy(request) == "fail":
                request.status = RequestStatus.FINISHED_ERROR
                request.error = f"KV cache transfer from the prefill engine failed: {result.error}"
                update.failed.append(request)
            else:
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING
                update.resume.append(request)
        for req_id in output.claimed_leases:
            self._end_lease(req_id)
        for req_id in output.expired_leases:
            leased = self.leased.get(req_id)
            params = leased[0].kv_transfer_params if leased is not None else None
            client_id = params.client_request_id if params is not None else None
            message = "KV lease of %s expired unclaimed; freeing its blocks"
            log_for(client_id, logger, logging.INFO, message, req_id)
            self.num_leases_expired += 1
            self._end_lease(req_id)
        return update

    def _end_lease(self, req_id: str) -> None:
        leased = self.leased.pop(req_id, None)
        if leased is not None:
            self.kv.free(leased[0])

    # ---- observability -----------------------------------------------------------------------

    @property
    def num_leased_blocks(self) -> int:
        return sum(n for _, n in self.leased.values())

    def take_transfer_results(self) -> list[TransferResult]:
        """The pulls (and refused params) that ended since the last call."""
        ended, self._ended = self._ended, []
        return ended
