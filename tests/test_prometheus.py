"""A real Prometheus (`baton serve --prometheus`) scraping a router, one prefill and two decode
engines of the tiny model under load: every query of the chart's Grafana dashboard, of its
prometheus-adapter rules and of the operator's HPAs returns plausible numbers, the adapter
exposes what the HPAs ask for and its values rise from idle to load, the chart's rules load and
evaluate, and promtool accepts them and the config serve generated.

One `baton serve` and one load phase for the module (`make test-long`): the adapter's queries
are sampled once idle before it and once during it; every other query runs after it, within
the queries' one-minute windows. The checks of promtool on the rules files, of the adapter
rules' rendering and of the flags run in `make test`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import yaml

from baton import serve
from baton.local_prometheus import LocalPrometheus, PrometheusConfig
from baton.operator.crd import DECODE_METRIC, PREFILL_METRIC
from baton.operator.resources import desired_children
from baton.operator.spec import parse_spec
from tests.support.ports import free_port
from tests.test_serve import ENGINE_FLAGS, ROOT, Serve, needs_roles

if shutil.which("prometheus") is None or shutil.which("promtool") is None:
    pytest.skip(
        "`prometheus` and `promtool` are not on PATH (apt-get install prometheus)",
        allow_module_level=True,
    )

CHART = ROOT / "charts" / "baton"
DASHBOARD = CHART / "dashboards" / "baton.json"
RULES = sorted((CHART / "rules").glob("*.yaml"))
ADAPTER_TEMPLATE = CHART / "templates" / "prometheus-adapter.yaml"
VALUES = CHART / "values.yaml"
MODEL = "tiny"
LOAD_SECONDS = 20.0
LOAD_THREADS = 8
# Engines run at most this many requests at once, so that the load queues some on the decode
# engines: their waiting requests move too.
MAX_NUM_SEQS = 2
# Grafana's variables in the dashboard's queries, as a user who picked this model sees them;
# any other variable stands for all its values.
VARIABLES = {
    "model_name": MODEL,
    "namespace": ".*",
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "5m",
}
# The dashboard marks panels that are empty (or zero) until something fails (failures,
# expiries, migrations, incompatibilities, ejections, retries) with this in their description.
EMPTY_WITHOUT_FAULTS = "(empty without faults)"
# Counters that any load moves: a rate of one of them is above zero after the load.
MOVING_COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "baton:router_requests",
)
# Labelled counters with no series until the first fault increments one: a query may name them
# though Prometheus has not seen them.
FAULT_ONLY_SERIES = {
    "baton:router_retries_total",
    "baton:router_upstream_errors_total",
    "baton:router_ejections_total",
    "baton:kv_transfer_failures_total",
    "baton:kv_transfer_incompatible_total",
}
PREFIX = "The relay team passes the baton in a marked zone, and the next runner " * 3
# Per pool, the adapter's metrics the module's load moves there: each pool's HPA default, and
# on the decode engines, where the requests queue and spend their time, every gauge. (A prefill
# of the tiny model takes milliseconds: a scrape seldom finds one running or waiting.)
MOVE_WITH_LOAD = {
    "prefill": {PREFILL_METRIC, "vllm:time_to_first_token_seconds_mean"},
    "decode": {
        DECODE_METRIC,
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_mean",
        "vllm:inter_token_latency_seconds_mean",
    },
}


def live(test: Callable[..., None]) -> Callable[..., None]:
    """A test on the live stack: slow, long, and needing prefill and decode engines."""
    return needs_roles(pytest.mark.long(pytest.mark.slow(test)))


@dataclass
class Stack:
    """The serve run, its Prometheus, its engines' pods by pool, and what the adapter gave
    them idle and under load."""

    serve: Serve
    prometheus: str
    config: Path  # the config serve generated (gone once serve stops)
    pools: dict[str, list[str]]  # pool -> pod names
    idle: Sample  # before any request
    loaded: Sample  # near the end of the load


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`baton serve` of 1 prefill + 2 decode engines with `--prometheus` scraping every second,
    after LOAD_SECONDS of load, the adapter's queries sampled idle and loaded; stopped
    (Prometheus too, its temp dir removed) at the end."""
    s = Serve(
        tmp_path_factory.mktemp("serve") / "serve.log",
        "--model", str(tiny_model("llama")), "--served-model-name", MODEL,
        "--prefill", "1", "--decode", "2", "--prometheus", str(free_port()),
        "--prometheus-scrape-interval", "1s", *ENGINE_FLAGS,
        "--max-num-seqs", str(MAX_NUM_SEQS),
    )  # fmt: skip
    config: Path | None = None
    try:
        s.wait_ready()
        prometheus, config = _banner(s)
        _wait_targets_up(prometheus, 4)
        pools: dict[str, list[str]] = {}
        for target in _targets(prometheus):
            if target["job"] == "baton-engine":
                pools.setdefault(target["pool"], []).append(target["pod"])
        time.sleep(2.5)  # two scrapes of every target: a rate has two samples
        idle = _sample(prometheus, pools)
        with ThreadPoolExecutor(1) as load:
            answered = load.submit(_load, s.url, LOAD_SECONDS)
            time.sleep(LOAD_SECONDS - 3)
            loaded = _sample(prometheus, pools)
        assert answered.result() > 20, f"only {answered.result()} requests answered"
        time.sleep(2.5)  # two more scrapes: the last requests are in
        yield Stack(s, prometheus, config, pools, idle, loaded)
    finally:
        code = s.stop()
    assert code == 0, s.log()
    assert config is not None and not config.parent.exists(), "serve left Prometheus's temp dir"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{prometheus}/-/healthy")


def _banner(s: Serve) -> tuple[str, Path]:
    """The URL and config file serve printed for its Prometheus (just after its banner)."""
    deadline = time.monotonic() + 10
    while not (found := re.search(r"Prometheus: (\S+) .*\(config (\S+)\)", s.log())):
        assert time.monotonic() < deadline, f"no Prometheus line:\n{s.log()}"
        time.sleep(0.1)
    return found[1], Path(found[2])


def _targets(prometheus: str) -> list[dict[str, str]]:
    """The labels of every active target, with `health` added."""
    r = httpx.get(f"{prometheus}/api/v1/targets", params={"state": "active"}, timeout=10)
    return [{**t["labels"], "health": t["health"]} for t in r.json()["data"]["activeTargets"]]


def _wait_targets_up(prometheus: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        targets = _targets(prometheus)
        if len(targets) == count and all(t["health"] == "up" for t in targets):
            return
        assert time.monotonic() < deadline, f"targets not up: {targets}"
        time.sleep(0.2)


def _load(url: str, seconds: float) -> int:
    """Streamed and whole completions and chats from LOAD_THREADS threads for `seconds`, on
    prompts that share a prefix (prefix-cache hits); the number of requests answered."""
    deadline = time.monotonic() + seconds
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    args: Any = {"model": MODEL, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
    streamed: Any = {**args, "stream": True, "stream_options": {"include_usage": True}}

    def tokens(kind: int, prompt: str) -> int | None:
        """One request: a whole or streamed completion or chat; the tokens it generated."""
        messages: Any = [{"role": "user", "content": prompt}]
        if kind == 0:
            whole = client.completions.create(prompt=prompt, **args)
            return whole.usage.completion_tokens if whole.usage else None
        if kind == 1:
            chat = client.chat.completions.create(messages=messages, **args)
            return chat.usage.completion_tokens if chat.usage else None
        if kind == 2:
            chunks: list[Any] = list(client.completions.create(prompt=prompt, **streamed))
        else:
            chunks = list(client.chat.completions.create(messages=messages, **streamed))
        return chunks[-1].usage.completion_tokens if chunks[-1].usage else None

    def worker(thread: int) -> int:
        done = 0
        while time.monotonic() < deadline:
            assert tokens(thread % 4, f"{PREFIX} {thread}.{done}") == 24
            done += 1
        return done

    with ThreadPoolExecutor(LOAD_THREADS) as pool:
        return sum(pool.map(worker, range(LOAD_THREADS)))


# ---- PromQL ----------------------------------------------------------------------------------


class PromQLError(Exception):
    pass


def _query(prometheus: str, expr: str) -> list[tuple[dict[str, str], float]]:
    """An instant query now: (labels, value) per series (a scalar is one without labels)."""
    r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=20)
    body = r.json()
    if body["status"] != "success":
        raise PromQLError(f"{body.get('errorType')}: {body.get('error')}")
    data = body["data"]
    if data["resultType"] == "scalar":
        return [({}, float(data["result"][1]))]
    if data["resultType"] != "vector":
        raise PromQLError(f"a {data['resultType']}, not an instant vector")
    return [(s["metric"], float(s["value"][1])) for s in data["result"]]


def _shown(series: list[tuple[dict[str, str], float]]) -> str:
    """A short view of a result for a failure message."""
    shown = [
        f"{{{','.join(f'{k}={v}' for k, v in labels.items() if k != '__name__')}}} {value}"
        for labels, value in series[:6]
    ]
    return "; ".join(shown) + (f"; ... ({len(series)} series)" if len(series) > 6 else "")


# ---- the dashboard ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    """One target of one dashboard panel."""

    title: str
    expr: str  # as written, with Grafana's variables
    unit: str
    description: str


def _panel_queries(dashboard: dict[str, Any]) -> list[PanelQuery]:
    """Every target with an `expr`, in panels, in collapsed rows' panels and in old-style rows."""
    queries: list[PanelQuery] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
            for target in panel.get("targets", []):
                if target.get("expr"):
                    title, description = panel.get("title", ""), panel.get("description", "")
                    queries.append(PanelQuery(title, target["expr"], unit, description))

    walk(dashboard.get("panels", []))
    for row in dashboard.get("rows", []):
        walk(row.get("panels", []))
    return queries


def _substitute(expr: str) -> str:
    """`expr` with Grafana's `$var`, `${var}`, `${var:format}` and `[[var]]` filled in."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        return VARIABLES.get(name, ".*")

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", value, expr)


def _problem(query: PanelQuery, series: list[tuple[dict[str, str], float]]) -> str | None:
    """What is implausible about `series` as the answer to `query` after the load; None when
    nothing is."""
    values = [v for _, v in series]
    finite = [v for v in values if math.isfinite(v)]
    title = query.title.lower()
    ratio = query.unit == "percentunit" or "hit rate" in title or "usage" in title
    if query.unit == "percent":
        low, high = 0.0, 100.0
    else:
        low, high = (0.0, 1.0) if ratio else (-math.inf, math.inf)
    out_of_range = [v for v in finite if not low <= v <= high]
    if out_of_range:
        return f"values outside [{low}, {high}]"
    if EMPTY_WITHOUT_FAULTS in query.description:
        return None  # only its range is checked: empty, zero or NaN is plausible here
    if not series:
        return "empty result"
    if any(math.isinf(v) for v in values):
        return "infinite values"
    if not finite:
        return "only NaN (no data flowed?)"
    if "histogram_quantile" in query.expr and min(finite) < 0:
        return "a negative quantile"
    moves = any(counter in query.expr for counter in MOVING_COUNTERS)
    if moves and re.search(r"\b(rate|irate|increase)\(", query.expr) and max(finite) <= 0:
        return "no series above zero for a counter the load moved"
    return None


@live
def test_every_dashboard_query_returns_plausible_values(stack: Stack) -> None:
    """Each `expr` of the dashboard, its variables filled in, is valid PromQL and returns a
    non-empty result with plausible values (rates above zero, ratios in [0, 1], finite
    quantiles), except in panels marked EMPTY_WITHOUT_FAULTS; all failures are listed."""
    assert DASHBOARD.exists(), f"no dashboard at {DASHBOARD}"
    queries = _panel_queries(json.loads(DASHBOARD.read_text()))
    assert queries, "the dashboard has no queries"
    failures = []
    for query in queries:
        expr = _substitute(query.expr)
        try:
            series = _query(stack.prometheus, expr)
        except PromQLError as e:
            failures.append(f"{query.title!r}: {expr}\n    -> {e}")
            continue
        problem = _problem(query, series)
        if problem is not None:
            failures.append(f"{query.title!r}: {expr}\n    -> {problem}: [{_shown(series)}]")
    assert not failures, f"{len(failures)} of {len(queries)} queries failed:\n" + "\n".join(
        failures
    )


# ---- prometheus-adapter and the HPAs ---------------------------------------------------------


@dataclass(frozen=True)
class AdapterRule:
    """One prometheus-adapter rule of the chart's ConfigMap."""

    series_query: str
    matches: str  # name.matches: a regular expression on a found series' name
    exposed_as: str  # name.as: the name in the custom metrics API, `${1}` the match's group
    metrics_query: str

    def exposed(self, series: str) -> str | None:
        """The name the adapter exposes `series` under; None if `matches` does not match it."""
        found = re.search(self.matches, series)
        return found.expand(re.sub(r"\$\{(\d+)\}", r"\\g<\1>", self.exposed_as)) if found else None

    def query(self, series: str, pods: list[str]) -> str:
        """The metricsQuery the adapter runs for `pods` of namespace `local` (serve's)."""
        matchers = f'namespace="local",pod=~"{"|".join(pods)}"'
        expr = self.metrics_query.replace("<<.Series>>", series)
        return expr.replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod")


def _adapter_config() -> dict[str, Any]:
    """The ConfigMap's `config.yaml` as the chart renders it from values.yaml, without helm:
    each `range` over a values list unrolled with `{{ . }}` filled in, `{{ $.Values.x.y }}`
    looked up (test_adapter_config_renders_as_helm_does holds it to helm's)."""
    values = yaml.safe_load(VALUES.read_text())
    text = ADAPTER_TEMPLATE.read_text().split("config.yaml: |\n", 1)[1]
    text = text.rsplit("{{- end }}", 1)[0]  # that of `if .Values.prometheusAdapter.enabled`

    def lookup(path: str) -> Any:
        value: Any = values
        for key in path.split("."):
            value = value[key]
        return value

    def unroll(found: re.Match[str]) -> str:
        return "".join(found[2].replace("{{ . }}", str(item)) for item in lookup(found[1]))

    text = re.sub(
        r"\s*\{\{- range \.Values\.([\w.]+) \}\}(.*?)\s*\{\{- end \}\}", unroll, text, flags=re.S
    )
    text = re.sub(r"\{\{ \$\.Values\.([\w.]+) \}\}", lambda found: str(lookup(found[1])), text)
    assert "{{" not in text, f"left unrendered:\n{text}"
    return dict(yaml.safe_load(textwrap.dedent(text)))


def _adapter_rules() -> list[AdapterRule]:
    rules = []
    for rule in _adapter_config()["rules"]:
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }, "the HPAs' Pods metrics need the namespace and pod labels mapped"
        name = rule["name"]
        rules.append(
            AdapterRule(rule["seriesQuery"], name["matches"], name["as"], rule["metricsQuery"])
        )
    return rules


def _exposed(prometheus: str) -> dict[str, tuple[AdapterRule, str]]:
    """What the adapter would serve from this Prometheus: each exposed metric name, with its
    rule and the series it queries, found as the adapter finds them (the rules' seriesQuery
    against /api/v1/series, then name.matches and name.as)."""
    exposed: dict[str, tuple[AdapterRule, str]] = {}
    for rule in _adapter_rules():
        r = httpx.get(
            f"{prometheus}/api/v1/series", params={"match[]": rule.series_query}, timeout=10
        )
        for series in {labels["__name__"] for labels in r.json()["data"]}:
            name = rule.exposed(series)
            assert name is not None, (
                f"{rule.series_query} found {series}, which {rule.matches} misses"
            )
            assert name not in exposed, f"two rules expose {name}"
            exposed[name] = (rule, series)
    return exposed


# Per pool, what the adapter gives each of its pods, by exposed metric name.
Sample = dict[str, dict[str, list[tuple[dict[str, str], float]]]]


def _sample(prometheus: str, pools: dict[str, list[str]]) -> Sample:
    """Every exposed metric evaluated as the adapter does for each pool's pods, now."""
    return {
        name: {pool: _query(prometheus, rule.query(series, pods)) for pool, pods in pools.items()}
        for name, (rule, series) in _exposed(prometheus).items()
    }


def _one_per_pod(sample: Sample, pools: dict[str, list[str]]) -> list[str]:
    """What in `sample` is not exactly one finite, non-negative value per pod of each pool."""
    failures = []
    for name, by_pool in sample.items():
        for pool, series in by_pool.items():
            pods = sorted(labels.get("pod", "?") for labels, _ in series)
            if pods != sorted(pools[pool]):
                failures.append(
                    f"{name} on {pool}: [{_shown(series)}], not one per pod {pools[pool]}"
                )
            elif not all(math.isfinite(v) and v >= 0 for _, v in series):
                failures.append(f"{name} on {pool}: implausible [{_shown(series)}]")
    return failures


def _pool_mean(sample: Sample, name: str, pool: str) -> float:
    return float(np.mean([v for _, v in sample[name][pool]])) if sample[name][pool] else math.nan


def _hpas() -> dict[str, dict[str, Any]]:
    """Pool -> the HPA the operator makes for a disaggregated InferenceService whose prefill and
    decode pools autoscale on their default metrics."""
    spec = {
        "model": {"uri": "hf://acme/llama", "servedModelName": MODEL},
        "image": "baton:1",
        "prefill": {"autoscaling": {"maxReplicas": 4}},
        "decode": {"autoscaling": {"maxReplicas": 8}},
    }
    isvc = {"metadata": {"name": "llama", "namespace": "local", "uid": "u"}, "spec": spec}
    hpas = [
        c
        for c in desired_children(isvc, parse_spec(spec))
        if c["kind"] == "HorizontalPodAutoscaler"
    ]
    return {hpa["metadata"]["name"].removeprefix("llama-"): hpa for hpa in hpas}


def test_adapter_config_renders_as_helm_does() -> None:
    """The tests' rendering of the adapter rules is helm's (skipped without helm)."""
    helm = shutil.which("helm")
    if helm is None:
        pytest.skip('helm not on PATH (export PATH="$(../shared/tools/get-helm.sh):$PATH")')
    rendered = subprocess.run(
        [helm, "template", "baton", str(CHART), "--set", "prometheusAdapter.enabled=true",
         "--show-only", "templates/prometheus-adapter.yaml"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    config_map = yaml.safe_load(rendered.stdout)
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == _adapter_config()


@live
def test_adapter_rules_give_one_value_per_engine_pod(stack: Stack) -> None:
    """Each prometheus-adapter rule finds every engine by its seriesQuery and exposes what
    values.yaml lists, and its metricsQuery, with the label matchers the adapter sends for one
    pool's pods, gives one finite value per pod of that pool: after the load, and when idle
    (an HPA needs a value then too, to scale down)."""
    all_pods = {pod for pods in stack.pools.values() for pod in pods}
    assert set(stack.pools) == {"prefill", "decode"} and len(all_pods) == 3, stack.pools
    values = yaml.safe_load(VALUES.read_text())["prometheusAdapter"]
    listed = {*values["metrics"], *(f"{h}_mean" for h in values["histograms"])}
    exposed = _exposed(stack.prometheus)
    assert set(exposed) == listed
    failures = []
    for rule, _ in exposed.values():
        found = _query(stack.prometheus, rule.series_query)
        if {labels.get("pod") for labels, _ in found} != all_pods:
            failures.append(f"{rule.series_query}: [{_shown(found)}], not every pod {all_pods}")
    failures += _one_per_pod(_sample(stack.prometheus, stack.pools), stack.pools)
    failures += [f"idle: {f}" for f in _one_per_pod(stack.idle, stack.pools)]
    assert not failures, "\n".join(failures)


@live
def test_hpas_ask_for_what_the_adapter_exposes(stack: Stack) -> None:
    """The HPAs the operator makes for autoscaled prefill and decode pools ask, per pod of
    their pool, for a metric name the adapter exposes (its name.as of a scraped series), with
    no selector the series could not meet, and its query gives one value per pod of the pool."""
    exposed = _exposed(stack.prometheus)
    hpas = _hpas()
    assert set(hpas) == {"prefill", "decode"}
    for pool, hpa in hpas.items():
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
        asked = metric["pods"]["metric"]
        assert asked["name"] == {"prefill": PREFILL_METRIC, "decode": DECODE_METRIC}[pool]
        assert asked["name"] in exposed, f"{pool}: the adapter exposes no {asked['name']}"
        assert "selector" not in asked, f"{pool}: a selector the adapter's rules do not map"
        rule, series = exposed[asked["name"]]
        answer = _query(stack.prometheus, rule.query(series, stack.pools[pool]))
        assert sorted(labels["pod"] for labels, _ in answer) == sorted(stack.pools[pool])
        assert all(0 <= v < math.inf for _, v in answer), _shown(answer)


@live
def test_adapter_values_move_with_load(stack: Stack) -> None:
    """What the adapter serves for each pool rises from idle to load for the metrics the load
    moves there (each pool's HPA default among them): the HPAs see the load."""
    failures = []
    for pool, names in MOVE_WITH_LOAD.items():
        for name in sorted(names):
            idle, loaded = _pool_mean(stack.idle, name, pool), _pool_mean(stack.loaded, name, pool)
            if not loaded > idle:
                failures.append(f"{name} on {pool}: idle {idle}, loaded {loaded}")
    assert not failures, "\n".join(failures)


# ---- the targets, the rules and the config ---------------------------------------------------


@live
def test_targets_carry_role_pool_and_pod(stack: Stack) -> None:
    """Each engine target is labelled with its role and pool, which match the router's view of
    the engine; the router is a target of its own."""
    roles = {e["url"].removeprefix("http://"): e["role"] for e in stack.serve.engines()}
    targets = _targets(stack.prometheus)
    engines = [t for t in targets if t["job"] == "baton-engine"]
    assert {t["instance"]: t["role"] for t in engines} == roles
    assert all(t["pool"] == t["role"] and t["pod"].startswith(t["pool"]) for t in engines)
    (router,) = [t for t in targets if t["job"] == "baton-router"]
    assert router["instance"] == f"127.0.0.1:{stack.serve.port}" and router["pod"] == "router"


@live
def test_every_series_the_dashboard_and_rules_name_exists(stack: Stack) -> None:
    """Each Baton or vLLM series a dashboard query or a rule names is one Prometheus scraped
    (but FAULT_ONLY_SERIES): a misspelt name evaluates to nothing, which an alert never
    fires on and `or vector(0)` in a panel hides."""
    exprs = [q.expr for q in _panel_queries(json.loads(DASHBOARD.read_text()))]
    for path in RULES:
        groups = yaml.safe_load(path.read_text())["groups"]
        exprs += [rule["expr"] for group in groups for rule in group["rules"]]
    named = {name for expr in exprs for name in re.findall(r"\b(?:vllm|baton):[\w:]+", expr)}
    r = httpx.get(f"{stack.prometheus}/api/v1/label/__name__/values", timeout=10)
    missing = named - set(r.json()["data"]) - FAULT_ONLY_SERIES
    assert not missing, f"named but never scraped: {sorted(missing)}"


@live
def test_rules_load_and_evaluate_without_errors(stack: Stack) -> None:
    """Prometheus loaded every rules file of the chart, each rule evaluates without error on
    the live metrics, and no alert is pending or firing under a load without faults."""
    assert RULES, f"no rules files in {CHART / 'rules'}"
    r = httpx.get(f"{stack.prometheus}/api/v1/rules", timeout=10).json()
    groups = r["data"]["groups"]
    assert {Path(g["file"]).resolve() for g in groups} == {p.resolve() for p in RULES}
    broken = [
        f"{rule['name']}: {rule.get('lastError')}"
        for group in groups
        for rule in group["rules"]
        if rule.get("health") != "ok"
    ]
    assert not broken, "\n".join(broken)
    alerts = httpx.get(f"{stack.prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    assert not alerts, json.dumps(alerts, indent=1)


@live
def test_generated_config_passes_promtool(stack: Stack) -> None:
    """`promtool check config` accepts the config serve wrote (and the rules it names)."""
    check = subprocess.run(
        ["promtool", "check", "config", str(stack.config)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("rules", RULES or [None], ids=lambda p: p.name if p else "none")
def test_rules_files_pass_promtool(rules: Path | None) -> None:
    """`promtool check rules` accepts each rules file of the chart."""
    assert rules is not None, f"no rules files in {CHART / 'rules'}"
    check = subprocess.run(
        ["promtool", "check", "rules", str(rules)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_prometheus_flags() -> None:
    """`--prometheus` alone listens on 9090 and scrapes every 5s; a port and an interval may be
    given; an interval Prometheus would refuse is refused up front."""
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    assert serve.plan_from_args(parser.parse_args([])).prometheus is None
    default = serve.plan_from_args(parser.parse_args(["--prometheus"])).prometheus
    assert default == PrometheusConfig(9090, "5s")
    words = ["--prometheus", "9191", "--prometheus-scrape-interval", "1m30s"]
    assert serve.plan_from_args(parser.parse_args(words)).prometheus == PrometheusConfig(
        9191, "1m30s"
    )
    for interval in ("0s", "5", "5 s", "s", "1s1m"):
        with pytest.raises(ValueError, match="scrape-interval"):
            PrometheusConfig(9090, interval)
    with pytest.raises(ValueError, match="port"):
        PrometheusConfig(0)


def test_serve_without_prometheus_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With no `prometheus` on PATH, `baton serve --prometheus` fails before any engine starts,
    naming the package to install."""
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    plan = serve.plan_from_args(parser.parse_args(["--prometheus"]))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="apt-get install prometheus"):
        serve.Supervisor(plan, startup_timeout=1, stop_timeout=1)
    with pytest.raises(FileNotFoundError, match=r"prometheus\.io/download"):
        LocalPrometheus(PrometheusConfig())
