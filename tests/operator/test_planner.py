"""The SLO planner (`baton.operator.planner`): its capacity models learn a synthetic engine, its
decisions keep to the bounds and the cool-down, and on a short simulated day it meets the aim."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np
import pytest

from baton.operator.planner import Observation, Planner, PlannerConfig
from baton.operator.spec import PlannerSpec
from bench.planner_sim import EngineModel, TraceConfig, compare

SPEC = PlannerSpec(
    ttft_seconds=1.0,
    itl_seconds=0.02,
    interval_seconds=30,
    cooldown_seconds=120,
    prefill_min=1,
    prefill_max=20,
    decode_min=1,
    decode_max=20,
)


@dataclass(frozen=True)
class SyntheticService:
    """Engines that behave as the planner's models say, with multiplicative noise on every
    latency: a prefill engine is an M/M/1 queue of `mu` tokens/s whose TTFT p90 is
    `overhead + tail * W`; a decode engine's ITL is `itl_a + itl_b * streams`."""

    mu: float = 3000.0
    overhead: float = 0.05
    tail: float = 2.0
    itl_a: float = 0.006
    itl_b: float = 0.001
    prompt: float = 800.0
    output: float = 200.0
    noise: float = 0.1

    @property
    def prefill_capacity(self) -> float:
        """x*: prompt tokens/s one engine takes at SPEC's TTFT target."""
        return self.mu - self.tail * self.prompt / (SPEC.ttft_seconds - self.overhead)

    @property
    def decode_capacity(self) -> float:
        """Output tokens/s one engine gives at SPEC's ITL target."""
        return (SPEC.itl_seconds - self.itl_a) / self.itl_b / SPEC.itl_seconds

    def observe(
        self, rate: float, prefill: int, decode: int, rng: np.random.Generator
    ) -> Observation:
        def jitter() -> float:
            return float(np.exp(rng.normal(0.0, self.noise)))

        x = min(rate * self.prompt / prefill, 0.99 * self.mu)
        wait = self.prompt / (self.mu - x) * jitter()
        per_engine = rate * self.output / decode
        streams = per_engine * self.itl_a / max(1.0 - per_engine * self.itl_b, 0.01)
        itl = (self.itl_a + self.itl_b * streams) * jitter()
        return Observation(
            interval_s=SPEC.interval_seconds,
            requests=round(rate * SPEC.interval_seconds),
            prompt_tokens_mean=self.prompt,
            output_tokens_mean=self.output,
            prefill_replicas=prefill,
            decode_replicas=decode,
            prefill_tokens_per_s=x * prefill,
            decode_tokens_per_s=min(rate * self.output, decode * streams / itl),
            ttft_p90_s=self.overhead + self.tail * wait,
            ttft_mean_s=self.overhead + wait,
            prefill_ttft_mean_s=wait,
            itl_mean_s=itl,
        )


class Loop:
    """Closes the loop: each interval the service runs at the counts the planner last chose."""

    def __init__(self, planner: Planner, service: SyntheticService, seed: int = 0) -> None:
        self.planner, self.service = planner, service
        self.rng = np.random.default_rng(seed)
        self.now = 0.0
        self.counts = (SPEC.prefill_min, SPEC.decode_min)

    def run(self, rates: list[float]) -> list[tuple[int, int]]:
        """The counts chosen after each interval at `rates` (requests/s)."""
        chosen = []
        for rate in rates:
            self.planner.observe(self.service.observe(rate, *self.counts, self.rng))
            self.now += SPEC.interval_seconds
            decision = self.planner.decide(self.now, *self.counts)
            self.counts = (decision.prefill, decision.decode)
            chosen.append(self.counts)
        return chosen


def test_capacity_models_converge_on_a_synthetic_engine() -> None:
    """After intervals at varied load, mu, o, q, the ITL line and both capacities are within
    10% of the engine's own."""
    service = SyntheticService()
    planner = Planner(SPEC)
    rng = np.random.default_rng(1)
    for i in range(120):
        rate = 0.5 + 7.5 * (i % 12) / 11  # 0.5 .. 8 requests/s
        planner.observe(service.observe(rate, 3, 4, rng))
    assert planner.prefill.tokens_per_s == pytest.approx(service.mu, rel=0.1)
    assert planner.prefill.overhead_s == pytest.approx(service.overhead, rel=0.1)
    assert planner.prefill.tail == pytest.approx(service.tail, rel=0.1)
    a, b = planner.decode.line()
    assert a == pytest.approx(service.itl_a, rel=0.1)
    assert b == pytest.approx(service.itl_b, rel=0.1)
    per_prefill = planner.prefill.sustainable(service.prompt, SPEC.ttft_seconds)
    assert per_prefill == pytest.approx(service.prefill_capacity, rel=0.1)
    per_decode = planner.decode.streams_at(SPEC.itl_seconds) / SPEC.itl_seconds
    assert per_decode == pytest.approx(service.decode_capacity, rel=0.1)


def test_the_prior_is_what_the_planner_knows_before_any_interval() -> None:
    """With no observation yet the capacities are the prior's and `decide` holds the counts,
    clamped into the bounds."""
    config = PlannerConfig(prefill_tokens_per_s_prior=1500.0, decode_streams_prior=4.0)
    planner = Planner(SPEC, config)
    assert planner.prefill.tokens_per_s == 1500.0
    assert planner.decode.streams_at(SPEC.itl_seconds) == pytest.approx(4.0)
    decision = planner.decide(0.0, 0, 50)
    assert (decision.prefill, decision.decode) == (SPEC.prefill_min, SPEC.decode_max)


def test_decisions_stay_within_the_bounds() -> None:
    """A load far past what the bounds allow gets the maxima; no load gets the minima."""
    spec = replace(SPEC, prefill_min=2, prefill_max=5, decode_min=3, decode_max=6)
    loop = Loop(Planner(spec), SyntheticService())
    counts = loop.run([40.0] * 10)
    assert counts[-1] == (5, 6)
    assert all(2 <= p <= 5 and 3 <= d <= 6 for p, d in counts)
    counts = loop.run([0.0] * 200)
    assert counts[-1] == (2, 3)
    assert all(2 <= p <= 5 and 3 <= d <= 6 for p, d in counts)


def test_noisy_flat_load_does_not_flap() -> None:
    """Poisson arrivals at a flat 4 requests/s (about 9% noise an interval) and 10% noise on
    every latency: once settled, each pool changes at most twice (one excursion) in 150
    intervals, over 20 different draws."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        rates = [
            rng.poisson(4.0 * SPEC.interval_seconds) / SPEC.interval_seconds for _ in range(200)
        ]
        settled = Loop(Planner(SPEC), SyntheticService(), seed).run(rates)[50:]
        for pool in (0, 1):
            series = [c[pool] for c in settled]
            changes = sum(a != b for a, b in itertools.pairwise(series))
            assert changes <= 2, (seed, series)


def test_rising_load_scales_up_at_once() -> None:
    """The first decision after load doubles takes each pool to all it needs, no cool-down, at
    least what the new load needs at the engine's true capacity."""
    service = SyntheticService()
    loop = Loop(Planner(SPEC), service)
    before = loop.run([3.0] * 40)[-1]
    after = loop.run([6.0])[0]
    assert after == loop.planner.wanted()[:2]
    assert after[0] >= before[0] + 2 and after[1] >= before[1] + 1
    assert after[0] >= math.ceil(6.0 * service.prompt / service.prefill_capacity)
    assert after[1] >= math.ceil(6.0 * service.output / service.decode_capacity)


def test_falling_load_waits_for_the_cooldown_then_steps_down_one_engine_at_a_time() -> None:
    """After load falls, the counts hold for the cool-down, then drop by one engine a
    decision."""
    loop = Loop(Planner(SPEC), SyntheticService())
    high = loop.run([8.0] * 40)[-1]
    low = loop.run([1.0] * 40)
    held = SPEC.cooldown_seconds // SPEC.interval_seconds
    assert all(c == high for c in low[:held])
    for pool in (0, 1):
        series = [high[pool]] + [c[pool] for c in low]
        steps = [a - b for a, b in itertools.pairwise(series)]
        assert set(steps) <= {0, 1} and series[-1] < high[pool]


def test_a_short_simulated_day_meets_the_aim() -> None:
    """The day's shape in 4 simulated hours on engines like this machine's: the planner meets
    both targets in >= 99% of intervals on <= 70% of the engine-hours of fixed peak pools."""
    engine = EngineModel(  # round figures of docs/results/planner_calibration.json
        prefill_fixed_s=0.008,
        prefill_per_token_s=0.00013,
        prefill_per_token_squared_s=0.000000037,
        handoff_fixed_s=0.02,
        handoff_per_token_s=0.000006,
        decode_step_fixed_s=0.0083,
        decode_step_per_stream_s=0.00106,
        kv_capacity_tokens=65536,
        max_num_seqs=256,
    )
    result = compare(engine, TraceConfig(hours=4.0))
    planner, peak = result.runs["planner"], result.runs["peak"]
    assert planner.slo_met >= 0.99
    assert planner.engine_hours <= 0.7 * peak.engine_hours
    assert result.aim_met
