"""The SLO planner's live loop (`baton.operator.planner_loop`): its Observation from canned
Prometheus answers; in-process against the emulated API server, what it writes on load and what
it holds while Prometheus is away; and end to end, the operator process planning a real
`baton serve` scraped by a real Prometheus: up under load, as the simulation goes, and one step
down once the load is gone and the cool-down passed."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import httpx
import numpy as np
import openai
import pytest

from baton.kube import connect
from baton.operator.api import Api
from baton.operator.planner import Observation, Planner
from baton.operator.planner_loop import (
    PLANNER_MANAGER,
    PlannerLoops,
    Prometheus,
    PrometheusError,
    observation_queries,
    observe,
)
from baton.operator.reconciler import Reconciler, owns
from baton.operator.spec import PlannerSpec, parse_spec
from bench.planner_sim import EngineModel, PlannerPolicy, Simulation, Trace
from tests.operator.conftest import Kube, wait_for
from tests.support.ports import free_port
from tests.test_serve import ENGINE_FLAGS, Serve, needs_roles

NS = "local"  # what `baton serve --prometheus` labels its targets with
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
EVENTS = f"/api/v1/namespaces/{NS}/events"
# Targets no engine on this machine meets: any load needs more engines.
PLANNER: dict[str, Any] = {
    "ttftSeconds": 0.005,
    "itlSeconds": 0.001,
    "intervalSeconds": 5,
    "cooldownSeconds": 5,
    "prefill": {"minReplicas": 1, "maxReplicas": 4},
    "decode": {"minReplicas": 1, "maxReplicas": 4},
}
SPEC: dict[str, Any] = {
    "model": {"uri": "hf://acme/tiny", "servedModelName": "tiny"},
    "image": "b:1",
    "planner": PLANNER,
}
# A loaded interval: 10 requests/s of 40 prompt and 24 output tokens on one engine a pool.
LOADED = {
    "requests": 50.0,
    "prompt_tokens": 2000.0,
    "prefilled": 50.0,
    "output_tokens": 1200.0,
    "decoded": 50.0,
    "prefill_replicas": 1.0,
    "decode_replicas": 1.0,
    "ttft_p90": 0.4,
    "ttft_mean": 0.2,
    "prefill_ttft_mean": 0.05,
    "itl_mean": 0.03,
}


# ---- a canned Prometheus ---------------------------------------------------------------------


class CannedPrometheus:
    """Answers `/api/v1/query` with a one-series vector per known query (an empty one for any
    other), or with an error for every query; records the queries it was asked."""

    def __init__(self, answers: dict[str, float | None], error: str | None = None) -> None:
        self.answers, self.error = answers, error
        self.asked: list[str] = []
        self.url = ""
        self._runner: aiohttp.web.AppRunner | None = None

    async def _query(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        query = request.query["query"]
        self.asked.append(query)
        if self.error is not None:
            error = {"status": "error", "errorType": "bad_data", "error": self.error}
            return aiohttp.web.json_response(error, status=400)
        value = self.answers.get(query)
        result = [] if value is None else [{"metric": {}, "value": [time.time(), str(value)]}]
        data = {"resultType": "vector", "result": result}
        return aiohttp.web.json_response({"status": "success", "data": data})

    async def __aenter__(self) -> CannedPrometheus:
        app = aiohttp.web.Application()
        app.router.add_get("/api/v1/query", self._query)
        self._runner = aiohttp.web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await aiohttp.web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


def canned(namespace: str, name: str, interval: int, figures: dict[str, float]) -> dict[str, Any]:
    """The answers that give `figures` (keyed as `observation_queries` keys them)."""
    queries = observation_queries(namespace, name, interval)
    return {queries[key]: value for key, value in figures.items()}


def test_the_observation_is_built_from_prometheus_answers() -> None:
    """Counter deltas become per-request means and per-second rates, replicas and latencies
    come through, every query names the service's namespace, service and pool, and a figure with
    no series is None (a latency) or 0 (a counter)."""

    async def main() -> None:
        figures = LOADED | {"itl_mean": float("nan")}
        del figures["decoded"]
        answers = canned("serving", "llama", 5, figures)
        async with CannedPrometheus(answers) as prom, aiohttp.ClientSession() as session:
            obs = await observe(Prometheus(prom.url, session), "serving", "llama", 5)
        assert obs is not None
        assert (obs.interval_s, obs.requests) == (5.0, 50)
        assert obs.prompt_tokens_mean == 40.0
        assert obs.output_tokens_mean == 0.0  # no decode request finished: no mean
        assert (obs.prefill_tokens_per_s, obs.decode_tokens_per_s) == (400.0, 240.0)
        assert (obs.prefill_replicas, obs.decode_replicas) == (1.0, 1.0)
        assert (obs.ttft_p90_s, obs.ttft_mean_s, obs.prefill_ttft_mean_s) == (0.4, 0.2, 0.05)
        assert obs.itl_mean_s is None  # NaN: 0/0
        assert len(prom.asked) == len(LOADED)
        for query in prom.asked:
            assert 'namespace="serving",inference_service="llama",pool="' in query, query
            assert "[5s]" in query, query

    asyncio.run(main())


def test_no_targets_is_no_observation_and_a_bad_answer_raises() -> None:
    """Without `up` series for either pool there is nothing to plan from (None, not an idle
    service); an error answer raises PrometheusError."""

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            async with CannedPrometheus({}) as prom:
                assert await observe(Prometheus(prom.url, session), "a", "b", 30) is None
            async with CannedPrometheus({}, error="parse error") as prom:
                with pytest.raises(PrometheusError, match="parse error"):
                    await observe(Prometheus(prom.url, session), "a", "b", 30)

    asyncio.run(main())


# ---- the loop against the emulated API server ------------------------------------------------


def run_loops(
    kube: Kube, tmp_path: Path, address: str, body: Callable[[PlannerLoops], Awaitable[None]]
) -> None:
    """Reconciles the service `local` once (its Deployments exist) and runs `body` with planner
    loops reading `address`."""

    async def main() -> None:
        cluster = await connect(str(kube.server.write_kubeconfig(tmp_path / "kubeconfig")))
        loops = PlannerLoops(Api(cluster), address)
        try:
            await Reconciler(Api(cluster)).reconcile(NS, "local")
            await body(loops)
        finally:
            await loops.close()
            await cluster.close()

    asyncio.run(main())


def replicas(kube: Kube, pool: str) -> int:
    deployment = kube.get(f"{DEPLOYMENTS}/local-{pool}") or {}
    return int(deployment.get("spec", {}).get("replicas", 1))


def counts(kube: Kube) -> tuple[int, int]:
    return replicas(kube, "prefill"), replicas(kube, "decode")


def planner_events(kube: Kube) -> list[dict[str, Any]]:
    return [e for e in kube.server.objects("events", NS) if e.get("reason") == "PlannerScaled"]


def planner_status(kube: Kube) -> dict[str, Any]:
    return dict((kube.isvc(NS, "local") or {}).get("status", {}).get("planner") or {})


async def until(check: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def test_the_loop_applies_a_decision(kube: Kube, tmp_path: Path) -> None:
    """On a loaded interval the loop sets both pools' replicas as its own field manager, posts
    a PlannerScaled Event with the decision's reason, and writes status.planner; a spec
    without the planner stops the loop."""
    fast = PLANNER | {"intervalSeconds": 1}
    isvc = kube.apply_isvc(NS, "local", SPEC | {"planner": fast})

    async def body(loops: PlannerLoops) -> None:
        async with CannedPrometheus(canned(NS, "local", 1, LOADED)) as prom:
            loops.prometheus_address = prom.url
            loops.sync(isvc)
            await until(lambda: planner_status(kube), 10, "status.planner")
            assert loops.running() == {(NS, "local")}
            loops.sync({**isvc, "spec": SPEC | {"planner": fast | {"enabled": False}}})
            await asyncio.sleep(0)
            assert loops.running() == set()

    run_loops(kube, tmp_path, "", body)
    planner = Planner(parse_spec(SPEC | {"planner": fast}).planner)  # type: ignore[arg-type]
    planner.observe(
        Observation(1.0, 50, 40.0, 24.0, 1.0, 1.0, 2000.0, 1200.0, 0.4, 0.2, 0.05, 0.03)
    )
    want = planner.decide(0.0, 1, 1)
    assert want.prefill == 4  # no engine meets a 5 ms TTFT
    assert (replicas(kube, "prefill"), replicas(kube, "decode")) == (want.prefill, want.decode)
    status = planner_status(kube)
    assert (status["prefill"], status["decode"]) == (want.prefill, want.decode)
    assert status["reason"] == want.reason
    assert status["observed"]["requestsPerSecond"] == 50.0
    assert status["observed"]["ttftP90Seconds"] == 0.4
    [event] = planner_events(kube)
    assert event["type"] == "Normal"
    assert event["message"] == want.reason
    deployment = kube.get(f"{DEPLOYMENTS}/local-prefill") or {}
    assert owns(deployment, PLANNER_MANAGER, ("f:spec", "f:replicas"))


def test_the_loop_holds_the_counts_while_prometheus_is_away(kube: Kube, tmp_path: Path) -> None:
    """With Prometheus unreachable, and then answering with no metrics of the pods, the
    replicas stay, no Event is posted, and status.planner says why."""
    isvc = kube.apply_isvc(NS, "local", SPEC | {"planner": PLANNER | {"intervalSeconds": 1}})

    async def body(loops: PlannerLoops) -> None:
        loops.sync(isvc)
        await until(lambda: "failed" in planner_status(kube).get("reason", ""), 10, "a reason")
        async with CannedPrometheus({}) as prom:
            loops.prometheus_address = prom.url
            await until(
                lambda: "no metrics" in planner_status(kube).get("reason", ""), 10, "no metrics"
            )

    run_loops(kube, tmp_path, f"http://127.0.0.1:{free_port()}", body)
    status = planner_status(kube)
    assert (status["prefill"], status["decode"]) == (1, 1)
    assert status["observed"] == {}  # nulls removed what there was
    assert "holding the counts" in status["reason"]
    assert (replicas(kube, "prefill"), replicas(kube, "decode")) == (1, 1)
    assert planner_events(kube) == []


# ---- end to end ------------------------------------------------------------------------------

LOAD_SECONDS = 25.0
LOAD_THREADS = 6


def simulated_rise() -> tuple[bool, bool]:
    """Whether the planner, in bench/planner_sim.py's simulation, asks for more prefill and
    more decode engines as the load rises from 0.5 to 8 requests/s of the live test's shape
    (prompts of ~40 tokens, 24 output tokens) over ten minutes, on engines like the tiny
    model's on a CPU."""
    rng = np.random.default_rng(0)
    seconds = 600
    rate = np.linspace(0.5, 8.0, seconds)
    counts = rng.poisson(rate)
    arrival = np.sort(np.repeat(np.arange(seconds), counts) + rng.random(counts.sum()))
    n = len(arrival)
    trace = Trace(arrival, np.full(n, 40), np.full(n, 24), rate, float(seconds))
    engine = EngineModel(0.01, 1e-4, 0.01, 0.0, 0.02, 0.002, 100_000, 256)
    spec = PlannerSpec(PLANNER["ttftSeconds"], PLANNER["itlSeconds"], 15, 5, 1, 4, 1, 4)
    sim = Simulation(trace, engine, startup_s=30.0)
    sim.run(PlannerPolicy(spec))
    bins = int(seconds // 15)
    return tuple(  # type: ignore[return-value]
        max(active[bins // 2 : bins]) > active[1] for active in sim.active
    )


def _prometheus_url(s: Serve) -> str:
    deadline = time.monotonic() + 10
    while not (found := re.search(r"Prometheus: (\S+)", s.log())):
        assert time.monotonic() < deadline, f"no Prometheus line:\n{s.log()}"
        time.sleep(0.1)
    return found[1]


def _up_targets(prometheus: str) -> int:
    r = httpx.get(f"{prometheus}/api/v1/targets", params={"state": "active"}, timeout=10)
    return sum(t["health"] == "up" for t in r.json()["data"]["activeTargets"])


@pytest.fixture()
def live_serve(tiny_model: Any, tmp_path: Path) -> Iterator[tuple[Serve, str]]:
    """`baton serve` of one prefill and one decode engine, its Prometheus scraping every second
    with the targets up; stopped at the end."""
    if shutil.which("prometheus") is None:
        pytest.skip("`prometheus` is not on PATH (apt-get install prometheus)")
    s = Serve(
        tmp_path / "serve.log",
        "--model", str(tiny_model("llama")), "--served-model-name", "tiny",
        "--prefill", "1", "--decode", "1", "--prometheus", str(free_port()),
        "--prometheus-scrape-interval", "1s", *ENGINE_FLAGS,
    )  # fmt: skip
    try:
        s.wait_ready()
        prometheus = _prometheus_url(s)
        wait_for(lambda: _up_targets(prometheus) == 3, timeout=30, what="3 targets up")
        yield s, prometheus
    finally:
        assert s.stop() == 0, s.log()


def _load(url: str, seconds: float) -> int:
    """Streamed chat completions from LOAD_THREADS threads for `seconds`; requests answered."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    deadline = time.monotonic() + seconds

    def worker(thread: int) -> int:
        done = 0
        while time.monotonic() < deadline:
            messages: Any = [{"role": "user", "content": f"Pass the baton, runner {thread}.{done}"}]
            stream = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=24, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert sum(1 for _ in stream) > 0
            done += 1
        return done

    with ThreadPoolExecutor(LOAD_THREADS) as pool:
        return sum(pool.map(worker, range(LOAD_THREADS)))


@pytest.mark.long
@pytest.mark.slow
@needs_roles
def test_the_operator_plans_a_live_service(
    live_serve: tuple[Serve, str], kube: Kube, start_operator: Callable[..., Any]
) -> None:
    """Under load the operator's planner raises the prefill and decode Deployments' replicas,
    as the simulation does for rising load, with PlannerScaled Events and status.planner;
    once the load has stopped and the cool-down passed, it takes a pool down one step."""
    serve, prometheus = live_serve
    rise = simulated_rise()
    assert any(rise), "the simulation should scale some pool up under rising load"
    start_operator(
        "--namespace", NS, "--prometheus-address", prometheus, "--kv-canary-seconds", "0"
    )  # fmt: skip
    kube.apply_isvc(NS, "local", SPEC)
    wait_for(
        lambda: {"local-prefill", "local-decode"} <= kube.names("deployments", NS),
        what="the engine Deployments",
    )
    assert (replicas(kube, "prefill"), replicas(kube, "decode")) == (1, 1)
    peak = [1, 1]
    with ThreadPoolExecutor(1) as load:
        answered = load.submit(_load, serve.url, LOAD_SECONDS)
        while not answered.done():
            peak = [max(top, n) for top, n in zip(peak, counts(kube), strict=True)]
            time.sleep(0.5)
    assert answered.result() > 20, f"only {answered.result()} requests answered"
    for pool, up, top in zip(("prefill", "decode"), rise, peak, strict=True):
        assert (top > 1) == up, f"{pool}: the simulation rises: {up}; live peaked at {top}"
    events = planner_events(kube)
    assert events and all(e["type"] == "Normal" for e in events)
    status = planner_status(kube)
    assert status["lastDecisionTime"] and status["reason"]

    # Idle: the predicted load decays to nothing within a few intervals, then one step down
    # a decision. (The decode pool may have come down during the load already, as the planner
    # learned its engines: the step counts from the most each pool had since the load.)
    now = most = counts(kube)
    deadline = time.monotonic() + 90
    while all(n >= m for n, m in zip(now, most, strict=True)):
        most = (max(most[0], now[0]), max(most[1], now[1]))
        assert time.monotonic() < deadline, f"no pool came down from {most}"
        time.sleep(0.02)
        now = counts(kube)
    steps = [m - n for n, m in zip(now, most, strict=True)]
    assert sorted(steps) in ([0, 1], [1, 1]), (now, most)
    idle = planner_status(kube)
    assert idle["observed"].get("requestsPerSecond", 0.0) == 0.0
    assert len(planner_events(kube)) > len(events)
