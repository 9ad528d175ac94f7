"""The SLO planner: how many prefill and how many decode engines a disaggregated service needs so
that TTFT and ITL stay under their targets, learned from what the service reports.

Pure logic, no I/O: the live loop turns each interval's deltas of the router's and engines'
/metrics into an `Observation`, calls `Planner.observe`, then `Planner.decide`, and applies the
`Decision`. Three parts, each simple enough to check by hand:

- capacity, learned online (no offline profile) from a prior that the first measured interval
  outweighs:
  - a prefill engine is a queue. Its requests' mean time in it (queue + prefill) is
    W = P / (mu - x) for P prompt tokens a request, x prompt tokens/s arriving at the engine and
    mu the tokens/s it prefills while busy (M/M/1, which is also M/G/1 when prompt lengths vary
    about as much as their mean). Each interval gives mu = x + P / W; the end-to-end TTFT adds
    an overhead o outside the engine (router, hand-off, first decode step) and a tail: the
    p90 is o + q * W. The most load an engine takes while the p90 stays at the target T is
    x* = mu - q * P / (T - o), mu and o averaged over recent intervals, q taken high (its 90th
    percentile), as the target holds per interval.
  - a decode engine's inter-token latency grows with the streams it batches: ITL = a + b * B,
    fitted by least squares over recent intervals, B from Little's law (streams = tokens/s *
    ITL). At the target it holds B* = (T - a) / b streams, B* / T tokens/s.
  Neither is taken below the most an engine carried in an interval that met its target.
- load: prompt and output tokens/s of the next interval, the larger of a smoothed level and the
  last interval (less its Poisson noise), plus the smoothed rise per interval carried two
  intervals ahead, so that rising load is met before it arrives (a new engine takes a while to
  start).
- the decision: the fewest engines that carry the predicted load times a margin (a headroom,
  more for a small pool, whose load is relatively noisier), within the spec's bounds. Up at
  once; down one engine per decision, and only once the load has fitted one engine fewer with a
  further 25% for the whole cool-down: noise in a flat load does not cross that band, so the
  pools do not flap.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from baton.operator.spec import PlannerSpec

# M/M/1: the time in the system is exponential, so its p90 is ln(10) times its mean.
_P90_OVER_MEAN = math.log(10.0)


@dataclass(frozen=True)
class Observation:
    """One interval of the service, from the deltas of Prometheus counters and histograms. Means
    and quantiles are None when the interval had nothing to measure them on."""

    interval_s: float
    requests: int  # requests that arrived (the router's requests counter)
    prompt_tokens_mean: float  # per arrived request
    output_tokens_mean: float  # per arrived request (generated, as the request ends)
    prefill_replicas: float  # prefill engines in service, mean over the interval
    decode_replicas: float  # (engines told apart by `baton:engine_info{role}`)
    prefill_tokens_per_s: float  # the prefill pool's vllm:prompt_tokens_total delta / interval
    decode_tokens_per_s: float  # the decode pool's vllm:generation_tokens_total delta / interval
    ttft_p90_s: float | None  # end to end: baton:router_time_to_first_byte_seconds
    ttft_mean_s: float | None
    prefill_ttft_mean_s: float | None  # prefill engines' vllm:time_to_first_token_seconds
    # The decode engines' mean gap between two tokens of a stream: their
    # vllm:inter_token_latency_seconds sum over (generation tokens - first tokens), as one
    # observation may span several tokens when the output is streamed in chunks.
    itl_mean_s: float | None

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if self.requests < 0 or self.prefill_replicas < 0 or self.decode_replicas < 0:
            raise ValueError("requests and replicas must be >= 0")


@dataclass(frozen=True)
class Decision:
    """The replicas each pool should have now, and why, in words for an event or a log line."""

    prefill: int
    decode: int
    reason: str


@dataclass(frozen=True)
class PlannerConfig:
    """How the planner learns and how much margin it keeps; the defaults suit a 30-60 s
    interval."""

    headroom: float = 1.3  # engines for this much more than the predicted load...
    # ... times 1 + noise_z / sqrt(requests predicted an interval); the last interval's rate
    # counts as noise_z / sqrt(its requests) less than measured.
    noise_z: float = 2.0
    scale_down_band: float = 0.25  # down only while the load fits one engine fewer this much over
    ewma_alpha: float = 0.3  # Holt's smoothing of the load: weight of the newest interval...
    trend_alpha: float = 0.3  # ... and of the newest rise
    lookahead_intervals: float = 2.0  # how far ahead a rise is carried: decide + start-up
    window: int = 240  # intervals of history the capacity models learn from
    min_requests: int = 5  # fewer in an interval are too few to learn from
    # The prior: what the planner assumes before it has measured anything, worth a few
    # requests, so that the first measured interval outweighs it.
    prefill_tokens_per_s_prior: float = 1000.0  # mu of one prefill engine
    decode_streams_prior: float = 4.0  # streams a decode engine holds at the ITL target
    prior_requests: float = 5.0  # how many requests' worth of evidence the prior counts as
    max_streams_per_engine: int = 256  # the engines' max_num_seqs

    def __post_init__(self) -> None:
        if self.headroom < 1.0 or self.noise_z < 0 or self.scale_down_band < 0:
            raise ValueError("headroom must be >= 1, noise_z and scale_down_band >= 0")
        for name in ("ewma_alpha", "trend_alpha"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.lookahead_intervals < 0 or self.window < 2 or self.min_requests < 1:
            raise ValueError("lookahead_intervals must be >= 0, window >= 2, min_requests >= 1")
        if min(self.prefill_tokens_per_s_prior, self.decode_streams_prior) <= 0:
            raise ValueError("the priors must be > 0")
        if self.prior_requests <= 0 or self.max_streams_per_engine < 1:
            raise ValueError("prior_requests must be > 0 and max_streams_per_engine >= 1")


# ---------------------------------------------------------------- capacity


class _PrefillPoint(NamedTuple):
    """What one interval says about a prefill engine."""

    requests: int
    load: float  # x: prompt tokens/s the engine took
    mu: float
    overhead: float  # o
    tail: float  # q
    ttft_p90: float | None


class PrefillModel:
    """mu (tokens/s a busy engine prefills) and o (TTFT outside the prefill engine), each a
    request-weighted mean over recent intervals with the prior counted as `prior_requests`
    requests, and q (TTFT p90 over the mean time in the engine) as high as it was in all but a
    tenth of them: the target holds per interval, and an interval's p90 moves with its mix of
    prompt lengths, the more so the fewer requests it has."""

    def __init__(self, config: PlannerConfig) -> None:
        self._prior_mu = config.prefill_tokens_per_s_prior  # the prior's o is 0, its q M/M/1's
        self._prior_weight = config.prior_requests
        self._min_requests = config.min_requests
        self._points: deque[_PrefillPoint] = deque(maxlen=config.window)

    def observe(self, obs: Observation) -> None:
        w = obs.prefill_ttft_mean_s
        if w is None or w <= 0 or obs.prefill_replicas <= 0 or obs.requests < self._min_requests:
            return
        x = obs.prefill_tokens_per_s / obs.prefill_replicas
        o, q = 0.0, _P90_OVER_MEAN  # the prior's, kept without an end-to-end TTFT
        if obs.ttft_mean_s is not None and obs.ttft_p90_s is not None:
            o = max(0.0, obs.ttft_mean_s - w)
            q = max(1.0, (obs.ttft_p90_s - o) / w)
        mu = x + obs.prompt_tokens_mean / w
        self._points.append(_PrefillPoint(obs.requests, x, mu, o, q, obs.ttft_p90_s))

    @property
    def tokens_per_s(self) -> float:
        """mu: prompt tokens/s one engine prefills while busy."""
        total = self._prior_weight * self._prior_mu + sum(p.requests * p.mu for p in self._points)
        return total / (self._prior_weight + sum(p.requests for p in self._points))

    @property
    def overhead_s(self) -> float:
        """o: the TTFT spent outside the prefill engine."""
        total = sum(p.requests * p.overhead for p in self._points)
        return total / (self._prior_weight + sum(p.requests for p in self._points))

    @property
    def tail(self) -> float:
        """q: TTFT p90 (less o) over the mean time in the prefill engine, its 90th percentile
        over the intervals' requests."""
        points = sorted(
            [(_P90_OVER_MEAN, self._prior_weight)] + [(p.tail, p.requests) for p in self._points]
        )
        total = sum(w for _, w in points)
        below = 0.0
        for q, w in points:
            below += w
            if below >= 0.9 * total:
                return q
        return points[-1][0]

    def sustainable(self, prompt_tokens: float, ttft_s: float) -> float:
        """x*: prompt tokens/s one engine takes with the TTFT p90 at `ttft_s`, and at least the
        most it took in an interval that met the target: the model extrapolates, and where it
        is more pessimistic than what was seen, what was seen wins."""
        seen = max(
            (p.load for p in self._points if p.ttft_p90 is not None and p.ttft_p90 <= ttft_s),
            default=0.0,
        )
        budget = ttft_s - self.overhead_s
        if budget <= 0:
            return seen
        return max(seen, self.tokens_per_s - self.tail * prompt_tokens / budget)


class DecodeModel:
    """ITL = a + b * streams per engine, by weighted least squares over recent intervals; the
    prior enters as two points on the line through (0, T/2) that reaches the target T at
    `decode_streams_prior` streams. An interval weighs its requests over its ITL squared: a
    latency's noise grows with it, and an overloaded interval (a long batch, a long ITL) would
    otherwise set the line's intercept, which matters most near the target."""

    def __init__(self, config: PlannerConfig, itl_target_s: float) -> None:
        a0 = itl_target_s / 2
        half = config.prior_requests / 2
        self._prior = [
            (half / a0**2, 0.0, a0),
            (half / itl_target_s**2, config.decode_streams_prior, itl_target_s),
        ]
        self._max_streams = float(config.max_streams_per_engine)
        self._min_requests = config.min_requests
        self._points: deque[tuple[float, float, float]] = deque(maxlen=config.window)

    def observe(self, obs: Observation) -> None:
        itl = obs.itl_mean_s
        if itl is None or itl <= 0 or obs.decode_replicas <= 0 or obs.requests < self._min_requests:
            return
        streams = obs.decode_tokens_per_s / obs.decode_replicas * itl  # Little's law
        self._points.append((obs.requests / itl**2, streams, itl))

    def line(self) -> tuple[float, float]:
        """(a, b): the fitted intercept (s) and slope (s per stream); b > 0."""
        points = [*self._prior, *self._points]
        sw = sum(w for w, _, _ in points)
        mx = sum(w * x for w, x, _ in points) / sw
        my = sum(w * y for w, _, y in points) / sw
        sxx = sum(w * (x - mx) ** 2 for w, x, _ in points)
        sxy = sum(w * (x - mx) * (y - my) for w, x, y in points)
        b = max(sxy / sxx, 1e-9)  # the prior's two points keep sxx > 0; ITL never falls with B
        a = my - b * mx
        if a < 0:  # no step takes negative time: fit the line through the origin instead
            sxx0 = sum(w * x * x for w, x, _ in points)
            return 0.0, max(sum(w * x * y for w, x, y in points) / sxx0, 1e-9)
        return a, b

    def streams_at(self, itl_s: float) -> float:
        """B*: streams one engine holds with the mean ITL at `itl_s`, and at least the most it
        held in an interval that met it."""
        a, b = self.line()
        seen = max((streams for _, streams, itl in self._points if itl <= itl_s), default=0.0)
        return min(self._max_streams, max(seen, (itl_s - a) / b))


# ---------------------------------------------------------------- load


class LoadPredictor:
    """The next interval's value of a rate: the larger of its smoothed level and the last
    interval, plus the smoothed rise per interval carried `lookahead` intervals ahead. Level and
    rise are Holt's double exponential smoothing (a fall moves the level, but is not carried
    ahead, so the level cannot overshoot below the load), and one noisy interval moves the rise
    little.
    The last interval counts less its noise: a rate measured on n requests is trusted only to
    within `noise_z` / sqrt(n) of itself, so a small pool's noise does not pass for a rise,
    while a burst on a large one is met at once. Scaling down late costs engines, not the
    SLO."""

    def __init__(self, alpha: float, trend_alpha: float, lookahead: float, noise_z: float) -> None:
        self._alpha, self._trend_alpha, self._lookahead = alpha, trend_alpha, lookahead
        self._noise_z = noise_z
        self._level: float | None = None
        self._trend = 0.0
        self._last = 0.0  # less its noise

    def update(self, value: float, requests: int) -> None:
        if self._level is None:
            self._level = value
        else:
            before = self._level
            level = self._level + max(0.0, self._trend)  # a fall is not carried ahead
            self._level = level + self._alpha * (value - level)
            self._trend += self._trend_alpha * (self._level - before - self._trend)
        self._last = value * max(0.0, 1.0 - self._noise_z / math.sqrt(max(requests, 1)))

    def predict(self) -> float:
        if self._level is None:
            return 0.0
        return max(self._level, self._last) + max(0.0, self._trend) * self._lookahead


# ---------------------------------------------------------------- decision


@dataclass
class _Pool:
    """One pool's bounds and cool-down."""

    low: int
    high: int
    lower_since: float | None = None  # since when the pool has more than it needs, if it has

    def clamp(self, n: int) -> int:
        return max(self.low, min(self.high, n))

    def settle(self, up: int, down: int, current: int, now: float, cooldown_s: float) -> int:
        """The count to have now. `up`: the engines the load needs, taken at once when more
        than `current`; `down`: the engines it needs with the dead band's extra margin, which
        must stay below `current` for the whole cool-down before the pool loses an engine."""
        up, down, current = self.clamp(up), self.clamp(down), self.clamp(current)
        if up > current:
            self.lower_since = None
            return up
        if down >= current:
            self.lower_since = None
            return current
        if self.lower_since is None:
            self.lower_since = now
        if now - self.lower_since >= cooldown_s:
            return current - 1  # one engine per decision while it stays more than needed
        return current


@dataclass
class Planner:
    """Call `observe` once per interval, then `decide` with the counts the pools have now."""

    spec: PlannerSpec
    config: PlannerConfig = field(default_factory=PlannerConfig)

    def __post_init__(self) -> None:
        s, c = self.spec, self.config
        if s.ttft_seconds <= 0 or s.itl_seconds <= 0:
            raise ValueError("the TTFT and ITL targets must be > 0")
        if not 1 <= s.prefill_min <= s.prefill_max or not 1 <= s.decode_min <= s.decode_max:
            raise ValueError("pool bounds must satisfy 1 <= min <= max")
        self.prefill = PrefillModel(c)
        self.decode = DecodeModel(c, s.itl_seconds)
        ahead = c.lookahead_intervals
        self._prompt_rate = LoadPredictor(c.ewma_alpha, c.trend_alpha, ahead, c.noise_z)
        self._output_rate = LoadPredictor(c.ewma_alpha, c.trend_alpha, ahead, c.noise_z)
        self._prompt_len = LoadPredictor(c.ewma_alpha, c.trend_alpha, 0.0, c.noise_z)
        self._pools = (_Pool(s.prefill_min, s.prefill_max), _Pool(s.decode_min, s.decode_max))
        self._observed = False

    def observe(self, obs: Observation) -> None:
        """Learns from one interval; call once per interval, before `decide`."""
        self.prefill.observe(obs)
        self.decode.observe(obs)
        rate = obs.requests / obs.interval_s
        self._prompt_rate.update(rate * obs.prompt_tokens_mean, obs.requests)
        self._output_rate.update(rate * obs.output_tokens_mean, obs.requests)
        if obs.requests:
            self._prompt_len.update(obs.prompt_tokens_mean, obs.requests)
        self._observed = True

    def wanted(self, extra: float = 1.0) -> tuple[int, int, str]:
        """The engines each pool needs for the predicted load times `extra`, before bounds and
        cool-down, and the figures behind them in words."""
        s, c = self.spec, self.config
        prompt_rate, output_rate = self._prompt_rate.predict(), self._output_rate.predict()
        prompt_len = self._prompt_len.predict()
        # An interval of n Poisson arrivals carries about 1/sqrt(n) more or less than its
        # mean: a relative margin that matters to a small pool and fades for a large one.
        requests = prompt_rate * s.interval_seconds / max(prompt_len, 1.0)
        margin = extra * c.headroom * (1 + c.noise_z / math.sqrt(max(requests, 1.0)))
        per_prefill = self.prefill.sustainable(prompt_len, s.ttft_seconds)
        per_decode = self.decode.streams_at(s.itl_seconds) / s.itl_seconds  # tokens/s
        prefill = _engines(margin * prompt_rate, per_prefill, s.prefill_max)
        decode = _engines(margin * output_rate, per_decode, s.decode_max)
        why = (
            f"{prompt_rate:.0f} prompt tok/s predicted, {per_prefill:.0f} per prefill engine at "
            f"TTFT p90 {s.ttft_seconds:g} s; {output_rate:.0f} output tok/s, {per_decode:.0f} "
            f"per decode engine at ITL {s.itl_seconds:g} s; margin {margin:.2f}"
        )
        return prefill, decode, why

    def decide(self, now: float, prefill: int, decode: int) -> Decision:
        """The counts the pools should have at time `now` (seconds, any monotonic origin), given
        the counts they have now."""
        pools, cooldown = self._pools, self.spec.cooldown_seconds
        if not self._observed:
            return Decision(
                pools[0].clamp(prefill), pools[1].clamp(decode), "no observation yet: holding"
            )
        up_p, up_d, why = self.wanted()
        down_p, down_d, _ = self.wanted(1 + self.config.scale_down_band)
        new_p = pools[0].settle(up_p, down_p, prefill, now, cooldown)
        new_d = pools[1].settle(up_d, down_d, decode, now, cooldown)
        return Decision(
            new_p,
            new_d,
            f"prefill {prefill}->{new_p} (needs {up_p}), decode {decode}->{new_d} "
            f"(needs {up_d}): {why}",
        )


def _engines(load: float, per_engine: float, most: int) -> int:
    """Engines for `load` at `per_engine` each; `most` when an engine can take none."""
    if load <= 0:
        return 0
    if per_engine <= 0:
        return most
    return math.ceil(load / per_engine)
