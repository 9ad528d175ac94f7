"""Scheduler overhead: CPU time of one `schedule()` + `update_from_output()` step, no model.

Decode-dominated steady state at 64, 256 and 1024 live requests (max_num_seqs = that size,
max_num_batched_tokens 8192, block size 16), two scenarios each:

- prefix: every prompt is a shared 512-token prefix plus 32 tokens of its own, blocks ample;
  all requests are decoding while measured (prompts computed during warm-up).
- pressure: 48-token unique prompts, 80 tokens each, about 5 blocks per request where a request
  needs up to 8: requests are preempted and resumed; a finished request is replaced at once so
  the number of live requests stays at the size.

The fake model samples one token per request that reached its length. Only the scheduler's own
calls are timed (process_time for CPU, perf_counter for wall), over many steps after warm-up.

    python bench/scheduler.py [--steps-scale 1.0] [--json out.json] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.kv_cache.manager import KVCacheConfig
from baton.engine.request import Request
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from baton.engine.scheduler.scheduler import Scheduler, SchedulerConfig

# vLLM 0.33's scheduler step (schedule + update_from_output) on this machine, ms.
VLLM_REFERENCE_MS = {64: 1.7, 256: 5.7, 1024: 30.0}
SIZES = (64, 256, 1024)
SCENARIOS = ("prefix", "pressure")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
BUDGET = 8192
EOS = 0


@dataclass
class Result:
    scenario: str
    num_requests: int
    steps: int
    cpu_ms_per_step: float
    wall_ms_per_step: float
    schedule_ms: float  # cpu
    update_ms: float  # cpu
    preemptions: int  # during the measured steps
    avg_running: float
    avg_scheduled_tokens: float
    vllm_ms: float

    @property
    def ratio(self) -> float:
        return self.cpu_ms_per_step / self.vllm_ms


class Workload:
    """Builds a scheduler and keeps feeding it requests for one scenario and size."""

    def __init__(self, scenario: str, size: int, num_steps: int, seed: int = 0) -> None:
        self.scenario = scenario
        self.size = size
        self.rng = random.Random(seed)
        self.next_id = 0
        if scenario == "prefix":
            self.prefix = [self.rng.randrange(1, 32000) for _ in range(512)]
            # Each request's own blocks for the whole run, plus the prefix once per request of
            # the first step: those compute it side by side, before it is cached.
            own = -(-(32 + num_steps) // BLOCK_SIZE) + 1
            first_wave = min(size, BUDGET // 544 + 1)
            num_blocks = first_wave * 512 // BLOCK_SIZE + size * own
        else:
            self.prefix = []
            num_blocks = size * 5
        self.scheduler = Scheduler(
            SchedulerConfig(MAX_MODEL_LEN, max_num_seqs=size, max_num_batched_tokens=BUDGET),
            KVCacheConfig(num_blocks, BLOCK_SIZE, enable_prefix_caching=True),
        )
        for _ in range(size):
            self.add()

    def add(self) -> None:
        if self.scenario == "prefix":
            prompt = self.prefix + [self.rng.randrange(1, 32000) for _ in range(32)]
            params = SamplingParams(max_tokens=None, ignore_eos=True)
        else:
            prompt = [self.rng.randrange(1, 32000) for _ in range(48)]
            params = SamplingParams(max_tokens=80, ignore_eos=True)
        self.scheduler.add_request(Request(f"r{self.next_id}", prompt, params, (EOS,)))
        self.next_id += 1

    def sampled(self, out: SchedulerOutput) -> ModelRunnerOutput:
        requests = self.scheduler.requests
        tokens = {}
        for rid in out.num_scheduled_tokens:
            request = requests[rid]
            if request.num_computed_tokens >= request.num_tokens:
                tokens[rid] = 1 + (request.num_tokens * 7919) % 31999
        return ModelRunnerOutput(tokens)

    def refill(self) -> None:
        for _ in range(self.size - self.scheduler.get_num_unfinished_requests()):
            self.add()


def run(scenario: str, size: int, steps: int, warmup: int) -> Result:
    work = Workload(scenario, size, warmup + steps)
    sched = work.scheduler
    for _ in range(warmup):
        out = sched.schedule()
        sched.update_from_output(out, work.sampled(out))
        work.refill()
    if scenario == "prefix":
        assert len(sched.running) == size, "warm-up did not bring every request to decode"
        assert sched.num_preemptions == 0, "the prefix scenario is meant to have ample blocks"
    sched_cpu = update_cpu = wall = 0.0
    running = tokens = 0
    preemptions_before = sched.num_preemptions
    for _ in range(steps):
        w0, c0 = time.perf_counter(), time.process_time()
        out = sched.schedule()
        c1 = time.process_time()
        wall += time.perf_counter() - w0
        runner_output = work.sampled(out)  # the "model": not timed
        w1, c2 = time.perf_counter(), time.process_time()
        sched.update_from_output(out, runner_output)
        c3 = time.process_time()
        wall += time.perf_counter() - w1
        sched_cpu += c1 - c0
        update_cpu += c3 - c2
        running += len(sched.running)
        tokens += out.total_num_scheduled_tokens
        work.refill()
    cpu = sched_cpu + update_cpu
    return Result(
        scenario=scenario,
        num_requests=size,
        steps=steps,
        cpu_ms_per_step=1e3 * cpu / steps,
        wall_ms_per_step=1e3 * wall / steps,
        schedule_ms=1e3 * sched_cpu / steps,
        update_ms=1e3 * update_cpu / steps,
        preemptions=sched.num_preemptions - preemptions_before,
        avg_running=running / steps,
        avg_scheduled_tokens=tokens / steps,
        vllm_ms=VLLM_REFERENCE_MS[size],
    )


def steps_for(scenario: str, size: int, scale: float) -> tuple[int, int]:
    """(measured steps, warm-up steps): fewer steps for larger sizes, about the same work.

    The pressure scenario warms up past the first generation of requests (80 tokens each), so
    that finishing, refilling, preemption and resumption are all in their steady state."""
    measured = max(20, int(scale * 64 * 1600 / size))
    return measured, (40 if scenario == "prefix" else 240)


def print_table(results: list[Result]) -> None:
    print(
        f"{'scenario':<9} {'reqs':>5} {'steps':>5} {'cpu ms':>8} {'wall ms':>8} "
        f"{'sched':>7} {'update':>7} {'running':>8} {'tok/step':>8} {'preempt':>7} "
        f"{'vLLM ms':>8} {'ours/vLLM':>9}"
    )
    for r in results:
        print(
            f"{r.scenario:<9} {r.num_requests:>5} {r.steps:>5} {r.cpu_ms_per_step:>8.3f} "
            f"{r.wall_ms_per_step:>8.3f} {r.schedule_ms:>7.3f} {r.update_ms:>7.3f} "
            f"{r.avg_running:>8.1f} {r.avg_scheduled_tokens:>8.1f} {r.preemptions:>7} "
            f"{r.vllm_ms:>8.1f} {r.ratio:>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply step counts")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--profile", action="store_true", help="cProfile the 1024 runs")
    args = parser.parse_args()

    results = []
    for scenario in SCENARIOS:
        for size in SIZES:
            steps, warmup = steps_for(scenario, size, args.steps_scale)
            results.append(run(scenario, size, steps, warmup))
    print_table(results)
    print(
        "cpu ms: schedule() + update_from_output() per step (process_time); vLLM ms: vLLM 0.33's "
        "step on this machine\n(reference figures, same sizes); ours/vLLM < 1 means Baton is "
        "faster."
    )
    if args.json:
        payload = {
            "block_size": BLOCK_SIZE,
            "max_num_batched_tokens": BUDGET,
            "results": [asdict(r) | {"ratio": r.ratio} for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.profile:
        for scenario in SCENARIOS:
            profiler = cProfile.Profile()
            steps, warmup = steps_for(scenario, 1024, args.steps_scale)
            profiler.runcall(run, scenario, 1024, steps, warmup)
            print(f"\n---- cProfile, {scenario}, 1024 requests (warm-up included) ----")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
