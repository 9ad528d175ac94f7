"""Baton's observability files and the chart objects that ship them: the Grafana dashboard (its
structure, and every query valid PromQL over only the dashboard's own variables), the alert
rules (promtool checks them, and its rule tests fire each alert on synthetic series and not on
healthy ones), the dashboard ConfigMap, the PrometheusRule, the gateway's PodMonitor and the
operator's PodMonitor flags. promtool and helm tests skip without them (helm: see
test_chart.py)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from baton.operator.cli import add_args

CHART = Path(__file__).resolve().parents[2] / "charts" / "baton"
DASHBOARD = CHART / "dashboards" / "baton.json"
RULES = CHART / "rules" / "baton-alerts.yaml"
PROMTOOL = shutil.which("promtool")
HELM = shutil.which("helm")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not on PATH (Prometheus' tools, e.g. apt install prometheus)"
)
needs_helm = pytest.mark.skipif(
    HELM is None, reason='helm not on PATH (export PATH="$(../shared/tools/get-helm.sh):$PATH")'
)
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# What each variable a query may use stands for when the query is checked: "All" for the
# namespace (also matches series without the label), a model regex, Grafana's rate window.
QUERY_VARIABLES = {"$namespace": ".*", "$model_name": "llama.*", "$__rate_interval": "1m"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    return [p for top in board["panels"] for p in (top, *top.get("panels", []))]


def queries(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in all_panels(board) for t in p.get("targets", [])]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def render(*sets: str) -> list[dict[str, Any]]:
    """The chart's objects as `helm template` renders them with `--set` for each of `sets`."""
    assert HELM is not None
    args = [a for s in sets for a in ("--set", s)]
    command = [HELM, "template", "baton", str(CHART), "--namespace", "baton-system", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def test_dashboard_structure() -> None:
    """The dashboard has unique panel ids, panels that do not overlap, a datasource variable
    that every panel, target and query variable uses, an "All" of `.*` on its filters, and
    an `expr` and a unique refId in every target."""
    board = dashboard()
    panels = all_panels(board)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for name in ("namespace", "model_name"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    assert "vllm:num_requests_running" in variables["model_name"]["query"]["query"]
    for variable in variables.values():
        if variable["type"] != "datasource":
            assert variable["datasource"] == DATASOURCE, variable["name"]
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        area = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert pos["x"] + pos["w"] <= 24 and not area & cells, panel["title"]
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]


def test_dashboard_queries_use_only_its_variables() -> None:
    """Queries use no variable but the namespace, the model and the rate window, and match the
    first two with `=~` (so "All", `.*`, also matches series without the label, as in
    `baton serve` without Kubernetes' target labels)."""
    for expr in queries(dashboard()):
        assert set(re.findall(r"\$\w+", expr)) <= set(QUERY_VARIABLES), expr
        for name in ("namespace", "model_name"):
            assert f'{name}="' not in expr and f'{name}!="' not in expr, expr


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every dashboard query, its variables filled in, parses as PromQL (promtool checks it as
    a recording rule)."""
    exprs = queries(dashboard())
    for variable, value in QUERY_VARIABLES.items():
        exprs = [e.replace(variable, value) for e in exprs]
    rules = [{"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


@needs_promtool
def test_alert_rules_pass_promtool() -> None:
    """`promtool check rules` accepts the rules file: queries, durations, label templates."""
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


# promtool rule tests: (input series, evaluation time, the alerts expected then). Each case has a
# series that should fire and one that should not.
ENGINE = 'job="engines", instance="10.0.0.{0}:8000", engine="0", kv_transport="tcp"'
ALERT_CASES: list[tuple[str, list[tuple[str, str]], str, list[dict[str, str]]]] = [
    (
        "BatonNoCompatiblePairs",
        [
            ('baton:router_compatible_pairs{namespace="ns", model="llama"}', "0x20"),
            ('baton:router_compatible_pairs{namespace="ns", model="phi"}', "0x20"),
            ('baton:router_compatible_pairs{namespace="ns", model="qwen"}', "2x20"),
            (
                f'baton:engine_info{{{ENGINE.format(1)}, model_name="llama", role="prefill"}}',
                "1x20",
            ),
            (f'baton:engine_info{{{ENGINE.format(2)}, model_name="phi", role="decode"}}', "1x20"),
            (f'baton:engine_info{{{ENGINE.format(3)}, model_name="qwen", role="prefill"}}', "1x20"),
        ],
        "10m",
        [{"namespace": "ns", "model": "llama", "severity": "critical"}],
    ),
    (
        "BatonKVLeaseExpiries",
        [
            ('baton:kv_lease_expired_total{namespace="ns", model_name="llama"}', "0+3x40"),
            ('baton:kv_lease_expired_total{namespace="ns", model_name="phi"}', "0x40"),
        ],
        "30m",
        [{"namespace": "ns", "model_name": "llama", "severity": "warning"}],
    ),
    (
        "BatonKVTransferFailures",
        [
            ('baton:kv_transfer_failures_total{model_name="llama", reason="TIMEOUT"}', "0+1x30"),
            ('baton:kv_transfer_seconds_count{model_name="llama"}', "0+10x30"),
            ('baton:kv_transfer_failures_total{model_name="phi", reason="TIMEOUT"}', "0+1x30"),
            ('baton:kv_transfer_seconds_count{model_name="phi"}', "0+100x30"),
        ],
        "20m",
        [{"model_name": "llama", "severity": "warning"}],
    ),
    (
        "BatonEngineUnhealthy",
        [
            (
                'baton:router_engine_healthy{instance="r1", engine="http://a", role="decode"}',
                "0x20",
            ),
            (
                'baton:router_engine_healthy{instance="r2", engine="http://a", role="decode"}',
                "0x20",
            ),
            (
                'baton:router_engine_healthy{instance="r1", engine="http://b", role="decode"}',
                "0x20",
            ),
            (
                'baton:router_engine_healthy{instance="r2", engine="http://b", role="decode"}',
                "1x20",
            ),
        ],
        "10m",
        [{"engine": "http://a", "role": "decode", "severity": "warning"}],
    ),
    (
        "BatonTimeToFirstTokenHigh",
        [
            ('vllm:time_to_first_token_seconds_bucket{model_name="llama", le="1"}', "0x30"),
            ('vllm:time_to_first_token_seconds_bucket{model_name="llama", le="10"}', "0+10x30"),
            ('vllm:time_to_first_token_seconds_bucket{model_name="llama", le="+Inf"}', "0+10x30"),
            ('vllm:time_to_first_token_seconds_bucket{model_name="phi", le="1"}', "0+10x30"),
            ('vllm:time_to_first_token_seconds_bucket{model_name="phi", le="10"}', "0+10x30"),
            ('vllm:time_to_first_token_seconds_bucket{model_name="phi", le="+Inf"}', "0+10x30"),
        ],
        "20m",
        [{"model_name": "llama", "severity": "warning"}],
    ),
]


@needs_promtool
@pytest.mark.parametrize("case", ALERT_CASES, ids=[c[0] for c in ALERT_CASES])
def test_each_alert_fires_on_what_it_watches(case: Any, tmp_path: Path) -> None:
    """promtool's rule test: the alert fires for the troubled series and only for it."""
    alert, series, at, expected = case
    groups = yaml.safe_load(RULES.read_text())["groups"]
    for group in groups:  # annotations are promtool check's business; compare labels only
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [
                    {
                        "eval_time": at,
                        "alertname": alert,
                        "exp_alerts": [{"exp_labels": labels} for labels in expected],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_helm
def test_the_dashboard_configmap_carries_the_file() -> None:
    """By default the chart renders a ConfigMap with the dashboard file's exact content and
    Grafana's sidecar label; the label, namespace and annotations are values; it can be off."""
    configmap = only(render(), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"] == {"baton.json": DASHBOARD.read_text()}
    configmap = only(
        render(
            "grafana.dashboard.label=dashboards",
            "grafana.dashboard.labelValue=baton",
            "grafana.dashboard.namespace=monitoring",
            "grafana.dashboard.annotations.grafana_folder=LLM",
        ),
        "ConfigMap",
    )
    meta = configmap["metadata"]
    assert meta["labels"]["dashboards"] == "baton" and "grafana_dashboard" not in meta["labels"]
    assert (meta["namespace"], meta["annotations"]) == ("monitoring", {"grafana_folder": "LLM"})
    assert not [d for d in render("grafana.dashboard.enabled=false") if d["kind"] == "ConfigMap"]


@needs_helm
def test_the_prometheus_rule_is_the_rules_file(tmp_path: Path) -> None:
    """Off by default; on, the PrometheusRule's spec is the rules file, but for the TTFT
    threshold taken from values, and still passes promtool."""
    assert not [d for d in render() if d["kind"] == "PrometheusRule"]
    rule = only(render("monitoring.prometheusRule.enabled=true"), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    sets = [
        "monitoring.prometheusRule.enabled=true",
        "monitoring.prometheusRule.ttftP99Seconds=2.5",
    ]
    rule = only(render(*sets, "monitoring.prometheusRule.labels.release=prom"), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prom"
    (group,) = rule["spec"]["groups"]
    exprs = {r["alert"]: r["expr"] for r in group["rules"]}
    assert "> 2.5 # ttftP99Seconds" in exprs["BatonTimeToFirstTokenHigh"]
    assert "> 5 " not in exprs["BatonTimeToFirstTokenHigh"]
    if PROMTOOL is not None:
        path = tmp_path / "rendered.yaml"
        path.write_text(yaml.safe_dump(rule["spec"]))
        result = promtool("check", "rules", str(path))
        assert result.returncode == 0, result.stdout + result.stderr


@needs_helm
def test_the_gateway_pod_monitor_selects_the_gateway_pods() -> None:
    """With the gateway and monitoring.podMonitor on, a PodMonitor selects the gateway's pods
    by labels they carry and scrapes /metrics on a port they name; without either, none."""
    docs = render("gateway.enabled=true", "monitoring.podMonitor.enabled=true")
    monitor = only(docs, "PodMonitor")
    gateway = next(
        d for d in docs if d["kind"] == "Deployment" and "gateway" in d["metadata"]["name"]
    )
    template = gateway["spec"]["template"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    ports = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    for sets in ([], ["gateway.enabled=true"], ["monitoring.podMonitor.enabled=true"]):
        assert not [d for d in render(*sets) if d["kind"] == "PodMonitor"]


def operator_flags(docs: list[dict[str, Any]]) -> argparse.Namespace:
    """The operator container's arguments, parsed as `baton operator` parses them."""
    operator = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "baton-operator"
    )
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    args = list(container["args"])
    parser = argparse.ArgumentParser()
    add_args(parser)
    return parser.parse_args(args[args.index("operator") + 1 :])


@needs_helm
def test_the_operator_is_told_how_to_make_pod_monitors() -> None:
    """The operator makes PodMonitors by default (15 s); the chart passes the interval and
    labels from values, or turns them off."""
    plain = operator_flags(render())
    assert (plain.pod_monitors, plain.pod_monitor_interval, plain.pod_monitor_label) == (
        True,
        "15s",
        [],
    )
    sets = (
        "monitoring.inferenceServices.interval=1m",
        "monitoring.inferenceServices.labels.release=kube-prometheus-stack",
    )
    told = operator_flags(render(*sets))
    assert (told.pod_monitor_interval, told.pod_monitor_label) == (
        "1m",
        ["release=kube-prometheus-stack"],
    )
    assert not operator_flags(render("monitoring.inferenceServices.podMonitors=false")).pod_monitors


@needs_helm
def test_the_operator_may_apply_pod_monitors_but_not_list_them() -> None:
    """The operator's ClusterRole lets it read, create and apply PodMonitors, nothing more."""
    role = next(d for d in render() if d["kind"] == "ClusterRole")
    rules = [r for r in role["rules"] if "monitoring.coreos.com" in r["apiGroups"]]
    assert [(r["resources"], r["verbs"]) for r in rules] == [
        (["podmonitors"], ["get", "create", "patch"])
    ]
