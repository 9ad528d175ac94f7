"""Builders and a fake model for driving the scheduler without a model."""

from __future__ import annotations

from baton.engine.kv_cache.manager import KVCacheConfig
from baton.engine.protocol import EngineCoreOutput
from baton.engine.request import Request
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from baton.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from baton.kv_transfer.base import KVConnectorBase
from baton.kv_transfer.params import KVTransferParams

EOS = 0
TOKEN = 5  # what the fake model samples unless told otherwise


def make_scheduler(
    *,
    max_model_len: int = 256,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    policy: str = "fcfs",
    num_blocks: int = 64,
    block_size: int = 4,
    caching: bool = True,
    connector: KVConnectorBase | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_model_len, max_num_seqs, max_num_batched_tokens, policy),
        KVCacheConfig(num_blocks, block_size, caching),
        connector,
    )


def make_request(
    req_id: str,
    num_prompt: int = 8,
    *,
    prompt: list[int] | None = None,
    max_tokens: int | None = 4,
    priority: int = 0,
    arrival: float = 0.0,
    group_id: str | None = None,
    kv_transfer_params: KVTransferParams | None = None,
    **params: object,
) -> Request:
    tokens = prompt if prompt is not None else [100 + i for i in range(num_prompt)]
    return Request(
        req_id,
        tokens,
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=(EOS,),
        arrival_time=arrival,
        priority=priority,
        group_id=group_id,
        kv_transfer_params=kv_transfer_params,
    )


def sampling_ids(sched: Scheduler, out: SchedulerOutput) -> list[str]:
    """Scheduled requests whose computed tokens reached their length: the ones that sample."""
    return [
        rid
        for rid in out.num_scheduled_tokens
        if rid in sched.requests
        and sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens
    ]


def step(
    sched: Scheduler, token: int = TOKEN, tokens: dict[str, int] | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step with a fake model that samples `token` (or `tokens[req_id]`)."""
    out = sched.schedule()
    sampled = {rid: (tokens or {}).get(rid, token) for rid in sampling_ids(sched, out)}
    return out, sched.update_from_output(out, ModelRunnerOutput(sampled))


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> dict[str, list[int]]:
    """Steps until nothing is left; returns every request's generated tokens."""
    generated: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return generated
        for o in step(sched)[1]:
            generated.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("requests did not finish")
