"""Continuous-batching scheduler (vLLM V1 design): one token budget per step, no phases."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from baton.engine.config import SCHEDULING_POLICIES
from baton.engine.kv_cache.block_pool import KVCacheBlock
from baton.engine.kv_cache.manager import KVCacheConfig, KVCacheManager
from baton.engine.protocol import EngineCoreOutput, EngineStats, LogprobsEntry
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from baton.engine.scheduler.remote_kv import RemoteKV
from baton.engine.scheduler.request_queue import make_queue
from baton.engine.scheduler.structured import GrammarManager
from baton.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput
from baton.kv_transfer.params import KVTransferParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")


class Scheduler:
    """Decides, each step, which requests compute how many tokens, within the KV memory there is."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_config: KVCacheConfig,
        connector: KVConnectorBase | None = None,
        structured_output_manager: GrammarManager | None = None,
    ) -> None:
        self.config = config
        # Structured outputs: the requests' grammars. The EngineCore sets it when the first
        # constrained request arrives; a scheduler without one refuses constrained requests.
        self.structured = structured_output_manager
        self.kv = KVCacheManager(kv_cache_config)
        # Disaggregated serving (a KV connector): parked pulls and leased blocks.
        self.remote_kv = RemoteKV(connector, self.kv) if connector is not None else None
        self.block_size = kv_cache_config.block_size
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()
        self._preempted_req_ids: set[str] = set()
        # group_id -> the sample of an n > 1 prompt currently filling the prefix cache; its
        # siblings wait a step so that they find the prompt blocks cached instead of recomputing.
        self._group_leaders: dict[str, Request] = {}
        self.num_preemptions = 0
        # Requests the scheduler ended on its own outside `update_from_output` (a grammar that
        # did not compile): their last outputs, until the EngineCore takes them.
        self._outputs: list[EngineCoreOutput] = []
        self._compiling: set[str] = set()  # requests in WAITING_FOR_FSM

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if request.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt is {request.num_prompt_tokens} tokens, more than max_model_len "
                f"{self.config.max_model_len}"
            )
        self._check_resumed(request)
        params = request.sampling_params.structured_outputs
        if params is not None:
            if self.structured is None:
                raise ValueError("this engine has no structured-output backend")
            # Compiles on the manager's pool; the request waits (WAITING_FOR_FSM) until done.
            self.structured.add_request(request.request_id, params)
            self._compiling.add(request.request_id)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _check_resumed(self, request: Request) -> None:
        """A resumed answer must leave room for one more token (the server checks first)."""
        num_output = request.num_output_tokens
        if not num_output:
            return
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt and resumed output are {request.num_tokens} tokens, which leaves no "
                f"room below max_model_len {self.config.max_model_len}"
            )
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and num_output >= max_tokens:
            raise ValueError(f"{num_output} resumed output tokens reach max_tokens {max_tokens}")

    def take_outputs(self) -> list[EngineCoreOutput]:
        """The outputs of requests ended outside `update_from_output`, once."""
        outputs, self._outputs = self._outputs, []
        return outputs

    def _fail(self, request: Request, error: str, error_status: int = 503) -> EngineCoreOutput:
        """Ends a request with an error; it must be out of `running` and `waiting` already."""
        request.status = RequestStatus.FINISHED_ERROR
        request.error = error
        self._free_request(request)
        return EngineCoreOutput(
            request.request_id,
            [],
            finish_reason="error",
            error=error,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error_status=error_status,
        )

    def _replay_output(self, request: Request) -> str | None:
        """Feeds the output a request starts with (a resumed answer's) to its just-compiled
        grammar, in order, as if it had sampled it here; why the grammar refused a token, or
        None. A request that starts with no output has nothing to feed."""
        for token in request.output_token_ids:
            if not self._structured.accept(request.request_id, token):
                why = self._structured.error(request.request_id) or "the grammar refused it"
                logger.warning("request %s (resumed token %d): %s", request.request_id, token, why)
                return f"structured outputs: resumed token {token}: {why}"
        return None

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Ends requests from outside the step (aborts, stop strings found by the detokenizer)."""
        if not status.finished:
            raise ValueError(f"{status.name} is not a finished status")
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                assert self.remote_kv is not None
                self.remote_kv.abort(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        if request.use_structured_output and self.structured is not None:
            self.structured.remove(request.request_id)
            self._compiling.discard(request.request_id)
        if self.remote_kv is None or not self.remote_kv.holds_blocks(request.request_id):
            self.kv.free(request)
        self._release_leader(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        # A request ended outside a step still owes its last output: the loop must step once.
        return (
            bool(self.running)
            or len(self.waiting) > 0
            or self._num_waiting_for_kvs() > 0
            or bool(self._outputs)
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + self._num_waiting_for_kvs()

    def _num_waiting_for_kvs(self) -> int:
        return len(self.remote_kv.waiting_for_kvs) if self.remote_kv is not None else 0

    def needs_sampled_tokens(self) -> bool:
        """Whether a constrained request has a sampled token not back yet. Its next mask
        depends on that token, so with async scheduling the EngineCore finishes the step in
        flight before scheduling the next (otherwise `schedule` skips the request a step).
        Preempted requests count too: one preempted with its token in flight may resume now."""
        if self.structured is None:
            return False
        return any(
            r.use_structured_output and r.num_output_placeholders for r in self.requests.values()
        )

    def is_compiling(self) -> bool:
        """Whether a request waits for its grammar: the busy loop then polls often, since
        nothing else wakes it when a compile ends."""
        return bool(self._compiling)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Hands out the step's token budget.

        There is no prefill phase and no decode phase: every request has `num_computed_tokens`
        catching up with `num_tokens`. Running requests are served first (a decode needs one
        token, a prompt chunk as many as the budget allows), then waiting ones, chunking long
        prompts. When blocks run out, the lowest-priority running request is preempted (its KV
        is dropped and recomputed later) and allocation is retried in the same step.
        """
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        new_block_ids: dict[str, list[int]] = {}
        preempted_now: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.use_structured_output and request.num_output_placeholders:
                # Its mask needs the token still in flight (async scheduling): next step.
                i += 1
                continue
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:  # at max_model_len; update_from_output finishes it
                i += 1
                continue
            while True:
                blocks = self.kv.allocate_slots(request, num_new)
                if blocks is not None:
                    break
                victim = self._pick_victim()
                if victim.request_id in num_scheduled:  # already given tokens this step
                    budget += num_scheduled.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id)
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim)
                preempted_now.append(victim)
                if victim is request:
                    break
            if blocks is None:
                continue  # the request preempted itself; `i` already points at the next one
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = [b.block_id for b in blocks]
            budget -= num_new
            i += 1

        for request in self.running:
            if request.request_id in num_scheduled:
                cached_reqs.append(
                    CachedRequestData(
                        req_id=request.request_id,
                        new_block_ids=new_block_ids[request.request_id],
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )

        # New work is admitted only when nothing had to be preempted: a preemption means the
        # cache is full and admitting would just preempt again next step.
        if not preempted_now:
            self._schedule_waiting(budget, num_scheduled, new_reqs, cached_reqs)

        constrained: list[str] = []  # requests with a grammar that sample this step
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples its next token
                if request.use_structured_output:
                    constrained.append(req_id)
        # A prompt chunk that does not reach the end samples nothing and needs no mask.
        bitmask = None
        if constrained:
            assert self.structured is not None
            bitmask = self.structured.bitmask(constrained)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=self._preempted_req_ids,
            structured_output_request_ids=constrained if bitmask is not None else [],
            grammar_bitmask=bitmask,
        )
        self._finished_req_ids = set()
        self._preempted_req_ids = set()
        return out

    def _num_new_tokens(self, request: Request, budget: int, num_hit: int = 0) -> int:
        """Tokens to compute this step, after `num_hit` prefix-cache tokens not yet counted."""
        num_computed = request.num_computed_tokens + num_hit
        pending = request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        if pending and max_tokens is not None and request.num_output_tokens + pending >= max_tokens:
            return 0  # its last token is already in flight (async scheduling)
        num_new = request.num_tokens + pending - num_computed
        room = self.config.max_model_len - num_computed
        return max(0, min(num_new, budget, room))

    def _schedule_waiting(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        cached_reqs: list[CachedRequestData],
    ) -> None:
        deferred: list[Request] = []
        while len(self.waiting) > 0 and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            if request.use_structured_output and request.num_output_placeholders:
                # Preempted with its token in flight (async scheduling): its mask needs it.
                deferred.append(self.waiting.pop())
                continue
            if request.status == RequestStatus.WAITING_FOR_FSM:
                assert self.structured is not None
                if not self.structured.is_ready(request.request_id):
                    deferred.append(self.waiting.pop())  # still compiling: skipped, not blocking
                    continue
                self._compiling.discard(request.request_id)
                error = self.structured.error(request.request_id)
                if error is not None:
                    self.waiting.pop()
                    logger.warning("grammar of request %s failed: %s", request.request_id, error)
                    self._outputs.append(self._fail(request, error))
                    continue
                refused = self._replay_output(request)
                if refused is not None:
                    self.waiting.pop()
                    self._outputs.append(self._fail(request, refused, error_status=400))
                    continue
                request.status = RequestStatus.WAITING
            leader = self._group_leaders.get(request.group_id or "")
            if leader is not None and leader is not request:
                deferred.append(self.waiting.pop())
                continue
            hits: list[KVCacheBlock] = []
            num_hit = 0
            if request.num_computed_tokens == 0:
                hits, num_hit = self.kv.get_computed_blocks(request)
                if self.remote_kv is not None and not request.kv_load_tried:
                    parked = self.remote_kv.start_load(request, hits, num_hit)
                    if parked is None:
                        break  # no room for its blocks yet
                    if parked:
                        self.waiting.pop()
                        continue
            num_new = self._num_new_tokens(request, budget, num_hit)
            # allocate_slots counts the hits on top of num_computed_tokens, so that only advances
            # once allocation succeeded (advancing it first counted every hit twice and
            # over-allocated one block per hit block).
            blocks = self.kv.allocate_slots(request, num_new, hits) if num_new > 0 else None
            if blocks is None:
                break
            request.num_computed_tokens += num_hit
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                request.first_scheduled_time = time.time()
            # Only a request with full prompt blocks left to fill leads its group: a sibling that
            # already hit them all has nothing for the others to wait for (making it the leader
            # admitted the siblings one per step).
            max_hit = (request.num_tokens - 1) // self.block_size * self.block_size
            if request.group_id is not None and self.kv.enable_caching and num_hit < max_hit:
                self._group_leaders.setdefault(request.group_id, request)
            block_ids = self.kv.block_ids(request.request_id)
            if request.status == RequestStatus.PREEMPTED:
                cached_reqs.append(
                    CachedRequestData(
                        req_id=request.request_id,
                        new_block_ids=block_ids,
                        num_computed_tokens=num_hit,
                        resumed=True,
                        all_token_ids=list(request.all_token_ids),
                    )
                )
            else:
                new_reqs.append(
                    NewRequestData(
                        req_id=request.request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=block_ids,
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        for request in reversed(deferred):
            self.waiting.prepend(request)

    def _release_leader(self, request: Request) -> None:
        """If `request` leads its group, its siblings no longer wait for it."""
        if self._group_leaders.get(request.group_id or "") is request:
            del self._group_leaders[request.group_id or ""]

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=_rank)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._release_leader(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        self._preempted_req_ids.add(request.request_id)
        self.waiting.prepend(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, applies stop conditions, frees what finished."""
        outputs: list[EngineCoreOutput] = []
        sampled = runner_output.sampled_token_ids
        stopped: list[Request] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # aborted while the step ran
            if request.status == RequestStatus.RUNNING:
                self.kv.cache_blocks(request)
                if request.num_computed_tokens >= request.num_prompt_tokens:
                    self._release_leader(request)  # its prompt blocks are cached now
            # A request preempted after this step was scheduled (async scheduling) still gets
            # its token: the step ran, and its recompute starts from all the tokens.
            token = sampled.get(req_id)
            if token is None:
                continue  # a partial prompt chunk: nothing sampled yet
            request.num_output_placeholders = max(0, request.num_output_placeholders - 1)
            if request.use_structured_output and not self._structured.accept(req_id, token):
                outputs.append(self._fail_running(request, token, stopped))
                continue
            request.append_output_token(token)
            self._check_stop(request, token)
            logprobs = runner_output.logprobs.get(req_id)
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if self._grammar_done_but_eos_blocked(request):
                # The token goes out first, then a separate, empty "stop": the output side
                # takes the last token of a "stop" output for an EOS or stop token and drops
                # its text, but this one is part of the answer.
                outputs.append(_output(request, [token], logprobs, prompt_logprobs))
                request.status = RequestStatus.FINISHED_STOPPED
                outputs.append(_output(request, [], None, None, self._kv_params(request)))
            else:
                kv_params = self._kv_params(request)
                outputs.append(_output(request, [token], logprobs, prompt_logprobs, kv_params))
            if request.is_finished():
                stopped.append(request)
        if stopped:
            done = set(map(id, stopped))
            before = len(self.running)
            self.running = [r for r in self.running if id(r) not in done]
            if len(self.running) + len(stopped) != before:  # some were preempted meanwhile
                for request in stopped:
                    if request in self.waiting:
                        self.waiting.remove(request)
            for request in stopped:
                self._free_request(request)
        return outputs

    @property
    def _structured(self) -> GrammarManager:
        assert self.structured is not None, "a constrained request without a grammar manager"
        return self.structured

    def _kv_params(self, request: Request) -> KVTransferParams | None:
        """A finished request's lease for its decode engine (prefill engines), or None."""
        if request.is_finished() and self.remote_kv is not None:
            return self.remote_kv.request_finished(request)
        return None

    def _grammar_done_but_eos_blocked(self, request: Request) -> bool:
        """Whether a running request's grammar is complete while EOS cannot end it.

        A complete grammar leaves EOS as the only token its mask allows. With `min_tokens` not
        reached, or `ignore_eos`, EOS would not end the request (and `min_tokens` would forbid
        it: a row with nothing allowed), so the request ends with "stop" here instead: the
        structured answer is whole and nothing may follow it.
        """
        if not request.use_structured_output or request.is_finished():
            return False
        params = request.sampling_params
        if not (params.ignore_eos or request.num_output_tokens < params.min_tokens):
            return False
        return self._structured.is_terminated(request.request_id)

    def _fail_running(
        self, request: Request, token: int, stopped: list[Request]
    ) -> EngineCoreOutput:
        """A constrained request's grammar refused its sampled token, or gave up (it cost
        more than the engine allows per token): the request ends with the grammar's reason, a
        400 (what the request asked cannot be followed), rather than with an answer that breaks
        its grammar."""
        why = self._structured.error(request.request_id) or "the grammar refused the token"
        logger.warning("request %s (token %d): %s", request.request_id, token, why)
        request.status = RequestStatus.FINISHED_ERROR
        request.error = f"structured outputs: {why}"
        stopped.append(request)
        return EngineCoreOutput(
            request.request_id,
            [],
            finish_reason="error",
            error=request.error,
            error_status=400,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _check_stop(self, request: Request, token: int) -> None:
        # Length first, as vLLM does: the last allowed token ends the request with "length"
        # even when it is also an EOS.
        params = request.sampling_params
        max_tokens = params.max_tokens
        if request.num_tokens >= self.config.max_model_len or (
            max_tokens is not None and request.num_output_tokens >= max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH
            return
        if request.num_output_tokens < params.min_tokens:
            return
        if not params.ignore_eos and token in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
        elif token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token

    def build_connector_meta(self) -> KVConnectorMetadata:
        """The KV connector's instructions for its worker half since the last call."""
        if self.remote_kv is None:
            return KVConnectorMetadata()
        return self.remote_kv.connector.build_connector_meta()

    @property
    def kv_refused(self) -> bool:
        """Whether requests whose KV params were refused under policy "fail" wait to end."""
        return self.remote_kv is not None and bool(self.remote_kv.refused)

    def update_from_kv_output(self, output: KVConnectorOutput) -> list[EngineCoreOutput]:
        """Applies what the connector's worker half reports: pulled requests resume at the
        front of `waiting`, failed ones end with an error, ended leases free their blocks."""
        if self.remote_kv is None:
            return []
        update = self.remote_kv.update(output)
        for request in reversed(update.resume):
            self.waiting.prepend(request)
        outputs = []
        for request in update.failed:
            outputs.append(
                EngineCoreOutput(request.request_id, [], finish_reason="error", error=request.error)
            )
            self._free_request(request)
        return outputs

    # ---- observability -------------------------------------------------------------------

    def make_stats(self, step_tokens: int = 0) -> EngineStats:
        """The engine's state now, with the KV pulls that ended since the last call."""
        remote = self.remote_kv
        return EngineStats(
            num_running=len(self.running),
            # Requests waiting for their remote KV wait too (vLLM counts them the same way).
            num_waiting=len(self.waiting) + self._num_waiting_for_kvs(),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.num_preemptions,
            step_tokens=step_tokens,
            kv_transfers=remote.take_transfer_results() if remote is not None else [],
            kv_blocks_leased=remote.num_leased_blocks if remote is not None else 0,
            kv_leases_expired=remote.num_leases_expired if remote is not None else 0,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()


def _output(
    request: Request,
    new_token_ids: list[int],
    logprobs: LogprobsEntry | None,
    prompt_logprobs: list[LogprobsEntry] | None,
    kv_params: KVTransferParams | None = None,
) -> EngineCoreOutput:
    """What one step reports for `request`: its new tokens, and how it ended if it did."""
    # The phase times go with the first token this engine sampled only (the empty "stop" after
    # a whole grammar has none).
    first = request.num_output_tokens == request.num_resumed_tokens + 1 and bool(new_token_ids)
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        new_logprobs=[logprobs] if logprobs is not None else None,
        prompt_logprobs=prompt_logprobs,
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=request.num_cached_tokens,
        num_external_tokens=request.num_external_tokens,
        queue_time=_queue_time(request) if first else None,
        prefill_time=_prefill_time(request) if first else None,
        kv_transfer_params=kv_params,
    )


def _queue_time(request: Request) -> float | None:
    if request.first_scheduled_time is None:
        return None
    return max(0.0, request.first_scheduled_time - request.arrival_time)


def _prefill_time(request: Request) -> float | None:
    """From first scheduled to now, as its first token is out: both on this process's clock."""
    if request.first_scheduled_time is None:
        return None
    return max(0.0, time.time() - request.first_scheduled_time)


def _rank(request: Request) -> tuple[int, float]:
    """Larger is less urgent: the priority policy preempts the largest."""
    return (request.priority, request.arrival_time)
