"""The scheduler's side of disaggregated serving: decode requests parked while their prompt KV is
pulled (WAITING_FOR_REMOTE_KVS), and finished prefill requests whose blocks are leased out.

A mixin of `Scheduler`, kept apart so that `schedule()` stays one readable page: the scheduler
calls `_start_remote_load` when it first considers a request, and the engine calls
`update_from_kv_output` with what the connector's worker half reports.
"""

from __future__ import annotations

import logging
import time

from baton.engine.kv_cache.block_pool import KVCacheBlock
from baton.engine.kv_cache.manager import KVCacheManager
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler.output import EngineCoreOutput
from baton.engine.scheduler.request_queue import RequestQueue
from baton.kv_transfer.base import KVConnectorOutput, TransferResult
from baton.kv_transfer.connector import PullConnector

logger = logging.getLogger(__name__)


class RemoteKVMixin:
    # Provided by Scheduler.
    connector: PullConnector | None
    kv: KVCacheManager
    waiting: RequestQueue
    waiting_for_kvs: dict[str, Request]
    leased: dict[str, Request]
    _free_after_load: dict[str, Request]
    kv_transfer_results: list[TransferResult]
    num_leases_expired: int

    def _free_request(self, request: Request) -> None:
        raise NotImplementedError

    def _start_remote_load(
        self, request: Request, hits: list[KVCacheBlock], num_hit: int
    ) -> bool | None:
        """Parks a decode request in WAITING_FOR_REMOTE_KVS with blocks for its remote prompt KV.

        True: parked; False: nothing to load, schedule it as usual; None: its blocks do not fit.
        """
        assert self.connector is not None
        num_external = self.connector.get_num_new_matched_tokens(request, num_hit)
        if num_external == 0:
            request.kv_load_tried = True
            self.connector.update_state_after_alloc(request, [], num_hit, 0)
            return False
        if self.kv.allocate_slots(request, num_external, hits) is None:
            return None
        request.kv_load_tried = True
        request.num_computed_tokens = num_hit
        self.waiting.pop()
        request.num_cached_tokens = num_hit
        request.first_scheduled_time = time.time()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_kvs[request.request_id] = request
        block_ids = self.kv.block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_hit, num_external)
        return True

    def update_from_kv_output(self, output: KVConnectorOutput) -> list[EngineCoreOutput]:
        """Continues requests whose pulls ended and frees blocks whose leases ended.

        A pulled request goes back to the front of `waiting` with all but its last prompt token
        computed. A failed pull follows the request's failure policy: "recompute" starts it over
        locally (its pulled blocks are dropped, since their contents are unknown); "fail" ends
        it with an error for the client.
        """
        outputs: list[EngineCoreOutput] = []
        connector = self.connector
        assert connector is not None
        results = output.finished_loads
        if connector.rejected:
            results = [*connector.rejected, *results]
            connector.rejected = []
        self.kv_transfer_results.extend(results)
        for result in results:
            aborted = self._free_after_load.pop(result.req_id, None)
            if aborted is not None:
                self.kv.free(aborted)
                continue
            request = self.waiting_for_kvs.pop(result.req_id, None)
            if result.ok and request is not None:
                request.num_computed_tokens = request.num_prompt_tokens - 1
                self.kv.cache_blocks(request)
                request.status = RequestStatus.WAITING
                self.waiting.prepend(request)
                continue
            if request is None:
                continue  # a rejected one: it never left `waiting` and is recomputed as usual
            logger.warning("KV load for %s failed: %s", result.req_id, result.error)
            if connector.failure_policy(request) == "fail":
                request.status = RequestStatus.FINISHED_ERROR
                request.error = f"KV cache transfer from the prefill engine failed: {result.error}"
                outputs.append(
                    EngineCoreOutput(
                        request.request_id, [], finish_reason="error", error=request.error
                    )
                )
                self._free_request(request)
            else:
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING
                self.waiting.prepend(request)
        for req_id in output.claimed_leases:
            self._end_lease(req_id)
        for req_id in output.expired_leases:
            logger.info("KV lease of %s expired unclaimed; freeing its blocks", req_id)
            self.num_leases_expired += 1
            self._end_lease(req_id)
        return outputs

    def _end_lease(self, req_id: str) -> None:
        request = self.leased.pop(req_id, None)
        if request is not None:
            self.kv.free(request)
        if self.connector is not None:
            self.connector.lease_ended(req_id)
