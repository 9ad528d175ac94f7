"""A real Prometheus (`baton serve --prometheus`) scraping a router, one prefill and two decode
engines of the tiny model under load: every query of the chart's Grafana dashboard, of its
prometheus-adapter rules and of the operator's HPAs returns plausible numbers, the chart's rules
load and evaluate, and promtool accepts them and the config serve generated.

One `baton serve` and one load phase for the module (`make test-long`); every query runs after
it, within the queries' one-minute windows. The checks of promtool on the rules files and of
the flags run in `make test`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from baton import serve
from baton.local_prometheus import LocalPrometheus, PrometheusConfig
from baton.operator.crd import DECODE_METRIC, PREFILL_METRIC
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


def live(test: Callable[..., None]) -> Callable[..., None]:
    """A test on the live stack: slow, long, and needing prefill and decode engines."""
    return needs_roles(pytest.mark.long(pytest.mark.slow(test)))


@dataclass
class Stack:
    """The serve run, its Prometheus, and its engines' pods by pool."""

    serve: Serve
    prometheus: str
    config: Path  # the config serve generated (gone once serve stops)
    pools: dict[str, list[str]]  # pool -> pod names


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`baton serve` of 1 prefill + 2 decode engines with `--prometheus` scraping every second,
    after LOAD_SECONDS of load; stopped (Prometheus too, its temp dir removed) at the end."""
    s = Serve(
        tmp_path_factory.mktemp("serve") / "serve.log",
        "--model", str(tiny_model("llama")), "--served-model-name", MODEL,
        "--prefill", "1", "--decode", "2", "--prometheus", str(free_port()),
        "--prometheus-scrape-interval", "1s", *ENGINE_FLAGS,
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
        answered = _load(s.url, LOAD_SECONDS)
        assert answered > 20, f"only {answered} requests answered"
        time.sleep(2.5)  # two more scrapes: the last requests are in
        yield Stack(s, prometheus, config, pools)
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
    """Streamed and whole completions and chats from four threads for `seconds`, on prompts
    that share a prefix (prefix-cache hits); the number of requests answered."""
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

    def worker(kind: int) -> int:
        done = 0
        while time.monotonic() < deadline:
            assert tokens(kind, f"{PREFIX} {kind}.{done}") == 24
            done += 1
        return done

    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(worker, range(4)))


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


def _adapter_queries() -> list[tuple[str, str, str]]:
    """(metric, seriesQuery, metricsQuery) per metric, rendered as the chart does from
    values.yaml's prometheusAdapter, without helm: the template's two query lines with their
    `{{ . }}` and `{{ .Values.x.y }}` filled in (the adapter's `<<...>>` left to fill)."""
    values = yaml.safe_load(VALUES.read_text())
    template = ADAPTER_TEMPLATE.read_text()
    lines = {k: re.search(rf"{k}: '(.+)'", template) for k in ("seriesQuery", "metricsQuery")}
    assert all(lines.values()), f"no seriesQuery/metricsQuery line in {ADAPTER_TEMPLATE}"

    def lookup(match: re.Match[str]) -> str:
        value: Any = values
        for key in match[1].split("."):
            value = value[key]
        return str(value)

    rendered = []
    for metric in values["prometheusAdapter"]["metrics"]:
        pair = []
        for found in lines.values():
            assert found is not None
            text = found[1].replace("{{ . }}", metric)
            text = re.sub(r"\{\{\s*\$?\.Values\.([\w.]+)\s*\}\}", lookup, text)
            assert "{{" not in text, f"left unrendered: {text}"
            pair.append(text)
        rendered.append((metric, pair[0], pair[1]))
    return rendered


@live
def test_adapter_rules_give_one_value_per_engine_pod(stack: Stack) -> None:
    """Each prometheus-adapter rule finds every engine by its seriesQuery, and its metricsQuery,
    with the label matchers the adapter sends for one pool's pods, gives one finite value per
    pod of that pool, labelled with the pool."""
    all_pods = {pod for pods in stack.pools.values() for pod in pods}
    assert set(stack.pools) == {"prefill", "decode"} and len(all_pods) == 3, stack.pools
    failures = []
    for metric, series_query, metrics_query in _adapter_queries():
        found = {labels.get("pod") for labels, _ in _query(stack.prometheus, series_query)}
        if found != all_pods:
            failures.append(f"{series_query}: pods {found}, not {all_pods}")
        for pool, pods in stack.pools.items():
            matchers = f'namespace="local",pod=~"{"|".join(pods)}"'
            expr = metrics_query.replace("<<.Series>>", metric)
            expr = expr.replace("<<.LabelMatchers>>", matchers)
            series = _query(stack.prometheus, expr)
            by_pod = sorted(labels["pod"] for labels, _ in series)
            if by_pod != sorted(pods) or any(labels["pool"] != pool for labels, _ in series):
                failures.append(f"{expr}: [{_shown(series)}], not one per {pool} pod {pods}")
            elif not all(math.isfinite(v) and v >= 0 for _, v in series):
                failures.append(f"{expr}: implausible [{_shown(series)}]")
    assert not failures, "\n".join(failures)


@live
def test_hpa_metrics_exist_per_engine_and_are_exposed(stack: Stack) -> None:
    """The metrics the operator's HPAs scale prefill and decode pools on are scraped from every
    engine, and the adapter exposes both."""
    adapter_metrics = {metric for metric, _, _ in _adapter_queries()}
    all_pods = sorted(pod for pods in stack.pools.values() for pod in pods)
    for metric in (PREFILL_METRIC, DECODE_METRIC):
        assert metric in adapter_metrics, f"prometheusAdapter.metrics lacks {metric}"
        series = _query(stack.prometheus, metric)
        assert sorted(labels["pod"] for labels, _ in series) == all_pods, _shown(series)
        assert all(0 <= v < math.inf for _, v in series), _shown(series)


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
