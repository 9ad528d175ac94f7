"""KEDA autoscaling: a pool with `autoscaling.engine: keda` gets a ScaledObject instead of an HPA
that passes KEDA's published CRD schema, whose Prometheus queries select exactly that pool's
series as the operator's PodMonitor labels them (checked by promtool), and that wakes a pool at
zero on the router's held requests; `minReplicas: 0` only with KEDA; against the emulated API
server, switching engines deletes the other autoscaler first, and a cluster without KEDA gets
`KEDANotInstalled` instead of a crash loop."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from baton.kube import connect
from baton.operator import crd
from baton.operator.api import Api
from baton.operator.monitoring import PodMonitorConfig, pod_monitor
from baton.operator.reconciler import Reconciler
from baton.operator.resources import (
    DEFAULT_PROMETHEUS_ADDRESS,
    KEDA_EXCLUDED_LABELS,
    desired_children,
)
from baton.operator.spec import parse_spec
from baton.operator.status import ready_condition, running_status
from baton.operator.validation import SpecError
from tests.operator.conftest import Kube, wait_for
from tests.operator.test_monitoring import meta_label
from tests.operator.test_observability import PROMTOOL, needs_helm, operator_flags, promtool, render

NS = "serving"
ISVC = f"/apis/baton.dev/v1alpha1/namespaces/{NS}/inferenceservices/llama"
SCALED_OBJECTS = f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects"
HPAS = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers"
META = {"name": "llama", "namespace": NS, "uid": "uid-1"}
SPEC: dict[str, Any] = {"model": {"uri": "hf://acme/llama-8b"}, "image": "b:1"}
KEDA = {"engine": "keda", "maxReplicas": 6}
SCHEMA_FILE = Path(__file__).parent / "data" / "keda-scaledobject-schema.yaml"
# The trigger metadata KEDA's prometheus scaler reads (pkg/scalers/prometheus_scaler.go).
PROMETHEUS_KEYS = {"serverAddress", "query", "threshold", "activationThreshold"}


def with_pools(**pools: dict[str, Any]) -> dict[str, Any]:
    return SPEC | {name: {"autoscaling": auto} for name, auto in pools.items()}


def scaled_objects(spec: dict[str, Any], **options: Any) -> dict[str, dict[str, Any]]:
    """Name -> ScaledObject of the children `spec` gets."""
    children = desired_children({"metadata": META, "spec": spec}, parse_spec(spec), **options)
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "ScaledObject"}


def strict(schema: Any) -> Any:
    """`schema` with unknown fields refused: the API server would drop them silently (pruning),
    so a misspelt field must fail the test rather than vanish."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    if schema.get("type") == "object" and "properties" in schema:
        result.setdefault("additionalProperties", False)
    return result


def keda_validator() -> jsonschema.Draft4Validator:
    """KEDA's openAPIV3Schema, which is OpenAPI 3.0's dialect of JSON Schema draft 4."""
    return jsonschema.Draft4Validator(strict(yaml.safe_load(SCHEMA_FILE.read_text())))


def check_for_keda(scaled: dict[str, Any]) -> None:
    """What KEDA needs of a ScaledObject beyond its schema: its CRD's CEL rule (min <= max)
    and prometheus triggers whose thresholds parse as numbers (KEDA reads float64s)."""
    keda_validator().validate(scaled)
    spec = scaled["spec"]
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus"
        assert set(trigger["metadata"]) <= PROMETHEUS_KEYS
        assert trigger["metricType"] in ("Value", "AverageValue")
        for key in ("threshold", "activationThreshold"):
            if key in trigger["metadata"]:
                float(trigger["metadata"][key])


SCHEMA_CASES = {
    "prefill-keda": with_pools(prefill=KEDA),
    "both-keda-to-zero": with_pools(
        prefill=KEDA | {"minReplicas": 0}, decode=KEDA | {"minReplicas": 0, "target": "850m"}
    ),
    "decode-keda-own-prometheus": with_pools(
        decode=KEDA | {"minReplicas": 2, "prometheusAddress": "https://thanos.obs.svc:10902"}
    ),
    "aggregated-to-zero": SPEC
    | {"mode": "aggregated", "engine": {"autoscaling": KEDA | {"minReplicas": 0}}},
}


@pytest.mark.parametrize("spec", SCHEMA_CASES.values(), ids=SCHEMA_CASES.keys())
def test_every_scaled_object_passes_kedas_schema(spec: dict[str, Any]) -> None:
    """Each ScaledObject the operator makes, with and without the wake trigger, for every kind
    of pool, passes KEDA v2.20's CRD schema with unknown fields refused."""
    found = scaled_objects(spec)
    assert found
    for scaled in found.values():
        check_for_keda(scaled)


def test_the_schema_check_can_fail() -> None:
    """The validator refuses what the API server would: a misspelt field, a missing trigger
    list, a number where KEDA wants strings, an empty scale target name."""
    (scaled,) = scaled_objects(with_pools(prefill=KEDA)).values()
    validator = keda_validator()
    broken = [copy.deepcopy(scaled) for _ in range(4)]
    broken[0]["spec"]["minReplicas"] = 1
    del broken[1]["spec"]["triggers"]
    broken[2]["spec"]["triggers"][0]["metadata"]["threshold"] = 4
    broken[3]["spec"]["scaleTargetRef"]["name"] = ""
    for obj in broken:
        assert not validator.is_valid(obj)


def test_a_keda_pool_gets_a_scaled_object_instead_of_an_hpa() -> None:
    """Prefill on KEDA, decode on an HPA: one ScaledObject for prefill, owned by the service,
    scaling its Deployment between the pool's bounds on the pool's metric and target, at the
    operator's Prometheus; the prefill Deployment's replicas are left to it; the labels KEDA
    would copy to its HPA leave out the operator's managed-by label."""
    waiting = {"metric": "vllm:num_requests_waiting", "target": 4}
    spec = with_pools(prefill=KEDA | waiting | {"minReplicas": 2}, decode={"maxReplicas": 4})
    children = desired_children({"metadata": META, "spec": spec}, parse_spec(spec))
    kinds = {(c["kind"], c["metadata"]["name"]): c for c in children}
    assert ("HorizontalPodAutoscaler", "llama-prefill") not in kinds
    assert ("HorizontalPodAutoscaler", "llama-decode") in kinds
    assert "replicas" not in kinds[("Deployment", "llama-prefill")]["spec"]
    scaled = kinds[("ScaledObject", "llama-prefill")]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    (owner,) = scaled["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceService", "uid-1", True)
    assert scaled["metadata"]["annotations"] == {
        KEDA_EXCLUDED_LABELS: "app.kubernetes.io/managed-by"
    }
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "llama-prefill",
    }
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 6)
    (load,) = scaled["spec"]["triggers"]  # no wake trigger: the pool never reaches zero
    assert load["metricType"] == "Value"  # an average over the pods, as the HPA's Pods metric
    assert load["metadata"] == {
        "serverAddress": DEFAULT_PROMETHEUS_ADDRESS,
        "query": 'avg(vllm:num_requests_waiting{namespace="serving",inference_service="llama",'
        'pool="prefill"})',
        "threshold": "4",
    }


def test_quantity_targets_become_keda_thresholds_and_addresses_come_from_spec_or_flag() -> None:
    """A target of 800m is KEDA's 0.8 (it parses thresholds as plain numbers); the pool's
    prometheusAddress wins over the operator's, which wins over the default."""
    spec = with_pools(
        prefill=KEDA | {"target": "1500m"},
        decode=KEDA | {"prometheusAddress": "http://thanos.obs:10902"},
    )
    found = scaled_objects(spec, prometheus="http://prom.ops:9090")
    prefill = found["llama-prefill"]["spec"]["triggers"][0]["metadata"]
    decode = found["llama-decode"]["spec"]["triggers"][0]["metadata"]
    assert (prefill["threshold"], decode["threshold"]) == ("1.5", "0.8")
    assert prefill["serverAddress"] == "http://prom.ops:9090"
    assert decode["serverAddress"] == "http://thanos.obs:10902"
    assert decode["query"].startswith(f"avg({crd.DECODE_METRIC}{{")


def test_a_histogram_mean_is_computed_as_the_adapter_computes_it() -> None:
    """`<histogram>_mean` (the prometheus-adapter's name, as the default prefill metric is) is
    no Prometheus series: the query takes each pod's rate of the sum over the rate of the count
    and averages those, as the adapter's rule and the HPA's Pods metric do."""
    (load,) = scaled_objects(with_pools(prefill=KEDA))["llama-prefill"]["spec"]["triggers"]
    assert crd.PREFILL_METRIC.endswith("_mean")  # else this test checks nothing
    histogram = crd.PREFILL_METRIC.removesuffix("_mean")
    pool = 'namespace="serving",inference_service="llama",pool="prefill"'
    assert load["metadata"]["query"] == (
        f"avg(rate({histogram}_sum{{{pool}}}[1m]) / "
        f"clamp_min(rate({histogram}_count{{{pool}}}[1m]), 1e-9))"
    )


def test_a_pool_that_may_sleep_is_woken_by_held_requests() -> None:
    """With minReplicas 0 a second trigger counts the service's held requests plus the pool's
    running ones, active above 0, one engine per maxNumSeqs of them."""
    spec = with_pools(decode=KEDA | {"minReplicas": 0}) | {"engine": {"maxNumSeqs": 64}}
    scaled = scaled_objects(spec)["llama-decode"]
    assert scaled["spec"]["minReplicaCount"] == 0
    load, wake = scaled["spec"]["triggers"]
    assert (load["name"], wake["name"], wake["metricType"]) == ("load", "wake", "AverageValue")
    service = 'namespace="serving",inference_service="llama"'
    assert wake["metadata"] == {
        "serverAddress": DEFAULT_PROMETHEUS_ADDRESS,
        "query": f"(sum(baton:router_held_requests{{{service}}}) or vector(0)) + "
        f'(sum(vllm:num_requests_running{{{service},pool="decode"}}) or vector(0))',
        "threshold": "64",
        "activationThreshold": "0",
    }


def series_labels(spec: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Deployment name -> the target labels the operator's PodMonitor gives its pods' series
    (Prometheus adds `namespace`; the relabelings copy pod labels)."""
    isvc = {"metadata": META, "spec": spec}
    parsed = parse_spec(spec)
    (endpoint,) = pod_monitor(isvc, parsed, PodMonitorConfig())["spec"]["podMetricsEndpoints"]
    result = {}
    for child in desired_children(isvc, parsed):
        if child["kind"] == "Deployment":
            pod = child["spec"]["template"]["metadata"]["labels"]
            meta = {meta_label(key): value for key, value in pod.items()}
            labels = {"namespace": NS}
            for relabeling in endpoint["relabelings"]:
                (source,) = relabeling["sourceLabels"]
                labels[relabeling["targetLabel"]] = meta[source]
            result[child["metadata"]["name"]] = labels
    return result


def series(metric: str, labels: dict[str, str], **extra: str) -> str:
    pairs = ", ".join(f'{k}="{v}"' for k, v in (labels | extra).items())
    return f"{metric}{{{pairs}}}"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not on PATH")
def test_the_queries_select_exactly_the_pools_series(tmp_path: Path) -> None:
    """promtool evaluates the queries over series labelled as the PodMonitor labels them,
    scraped every 15 s: each pool's load averages its own pods only (not the other pool's, not
    another service's, not another namespace's), for a histogram's mean (prefill's TTFT) as for
    a gauge (decode's KV usage); the wake query adds the service's held requests to the pool's
    running ones, is the held requests alone while the pool is at zero, and 0 with neither."""
    spec = with_pools(prefill=KEDA | {"minReplicas": 0}, decode=KEDA)
    found = scaled_objects(spec)
    prefill_load, wake = found["llama-prefill"]["spec"]["triggers"]
    (decode_load,) = found["llama-decode"]["spec"]["triggers"]
    labels = series_labels(spec)
    prefill, decode, router = (
        labels["llama-prefill"],
        labels["llama-decode"],
        labels["llama-router"],
    )
    assert (prefill["pool"], router["pool"], decode["inference_service"]) == (
        "prefill",
        "router",
        "llama",
    )
    other = prefill | {"inference_service": "other"}
    elsewhere = prefill | {"namespace": "staging"}
    ttft = crd.PREFILL_METRIC.removesuffix("_mean")
    kv, running = crd.DECODE_METRIC, "vllm:num_requests_running"
    held = "baton:router_held_requests"
    # Two prefill pods until minute 4, then none (scaled to zero: Prometheus keeps a series'
    # last sample for 5 minutes); the router holds 3 requests until minute 14, then none. Pod a
    # takes 1 s a request, pod b 3 s, both one request a second.
    until_4m, until_20m = 16, 80  # samples after the first, 15 s apart
    inputs = [
        (series(f"{ttft}_sum", prefill, pod="llama-prefill-a"), f"0+15x{until_4m}"),
        (series(f"{ttft}_count", prefill, pod="llama-prefill-a"), f"0+15x{until_4m}"),
        (series(f"{ttft}_sum", prefill, pod="llama-prefill-b"), f"0+45x{until_4m}"),
        (series(f"{ttft}_count", prefill, pod="llama-prefill-b"), f"0+15x{until_4m}"),
        (series(running, prefill, pod="llama-prefill-a"), f"1x{until_4m}"),
        (series(running, prefill, pod="llama-prefill-b"), f"1x{until_4m}"),
        (series(f"{ttft}_sum", decode, pod="llama-decode-a"), f"0+900x{until_20m}"),
        (series(f"{ttft}_count", decode, pod="llama-decode-a"), f"0+15x{until_20m}"),
        (series(running, decode, pod="llama-decode-a"), f"30x{until_20m}"),
        (series(kv, decode, pod="llama-decode-a"), f"0.5x{until_20m}"),
        (series(kv, decode, pod="llama-decode-b"), f"0.7x{until_20m}"),
        (series(kv, other | {"pool": "decode"}, pod="other-decode-a"), f"0.9x{until_20m}"),
        (series(f"{ttft}_sum", other, pod="other-prefill-a"), f"0+900x{until_20m}"),
        (series(f"{ttft}_count", other, pod="other-prefill-a"), f"0+15x{until_20m}"),
        (series(running, other, pod="other-prefill-a"), f"50x{until_20m}"),
        (series(f"{ttft}_sum", elsewhere, pod="llama-prefill-a"), f"0+900x{until_20m}"),
        (series(f"{ttft}_count", elsewhere, pod="llama-prefill-a"), f"0+15x{until_20m}"),
        (series(held, router, pod="llama-router-a", model="llama-8b"), "3x56 0x24"),
        (series(held, other | {"pool": "router"}, pod="other-router-a", model="x"), "9x80"),
    ]
    prefill_query, decode_query = (
        prefill_load["metadata"]["query"],
        decode_load["metadata"]["query"],
    )
    wake_query = wake["metadata"]["query"]
    cases: list[tuple[str, str, float | None]] = [
        ("2m", prefill_query, 2),  # (1 s + 3 s) / 2
        ("2m", decode_query, 0.6),  # (0.5 + 0.7) / 2
        ("2m", wake_query, 3 + 1 + 1),
        ("10m", prefill_query, None),  # no pods: no value (KEDA's ignoreNullValues reads 0)
        ("10m", wake_query, 3),  # at zero, woken by the held requests alone
        ("16m", wake_query, 0),  # at zero with nothing held: stays asleep
    ]
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": []}))
    expr_tests = [
        {
            "expr": expr,
            "eval_time": when,
            "exp_samples": [] if value is None else [{"labels": "{}", "value": value}],
        }
        for when, expr, value in cases
    ]
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [{"series": s, "values": v} for s, v in inputs],
                "promql_expr_test": expr_tests,
            }
        ],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("auto", "fragment"),
    [
        ({"minReplicas": 0, "maxReplicas": 3}, "minReplicas is 0, which needs engine: keda"),
        ({"engine": "hpa", "minReplicas": 0, "maxReplicas": 3}, "needs engine: keda"),
        (KEDA | {"metric": "up} or vector(100"}, "not a Prometheus metric name"),
        (KEDA | {"prometheusAddress": "prometheus:9090"}, "not an http:// or https:// URL"),
        (KEDA | {"target": "lots"}, "not a positive quantity"),
        ({"maxReplicas": 3, "target": "0"}, "not a positive quantity"),
    ],
)
def test_autoscaling_that_cannot_work_is_refused(auto: dict[str, Any], fragment: str) -> None:
    """Scale to zero only with KEDA (an HPA never wakes a Deployment at zero), a metric KEDA can
    put in a query, an address it can call, a target it can divide by: else
    InvalidAutoscaling, naming the field."""
    with pytest.raises(SpecError) as info:
        parse_spec(with_pools(decode=auto))
    assert info.value.reason == "InvalidAutoscaling"
    assert fragment in info.value.message and "spec.decode.autoscaling" in info.value.message


def test_autoscaling_bounds_and_defaults() -> None:
    """The engine defaults to hpa; minReplicas 0 is fine with keda, and below 0 is a schema
    error; a name that would give KEDA's HPA more than 63 characters is refused for keda."""
    (prefill, decode) = parse_spec(
        with_pools(prefill={"maxReplicas": 2}, decode=KEDA | {"minReplicas": 0})
    ).pools
    assert prefill.autoscaling is not None and prefill.autoscaling.engine == "hpa"
    assert decode.autoscaling is not None and decode.autoscaling.min_replicas == 0
    with pytest.raises(SpecError, match="must be at least 0"):
        parse_spec(with_pools(decode=KEDA | {"minReplicas": -1}))
    spec = with_pools(prefill=KEDA)
    name = "x" * (63 - len("keda-hpa--prefill"))
    desired_children({"metadata": META | {"name": name}, "spec": spec}, parse_spec(spec))
    with pytest.raises(SpecError) as info:
        isvc = {"metadata": META | {"name": name + "x"}, "spec": spec}
        desired_children(isvc, parse_spec(spec))
    assert info.value.reason == "NameTooLong" and "keda-hpa-" in info.value.message


def deployment(replicas: int, ready: int) -> dict[str, Any]:
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": replicas},
        "status": {"observedGeneration": 1, "readyReplicas": ready, "replicas": ready},
    }


def test_a_pool_asleep_at_zero_keeps_the_service_ready() -> None:
    """A pool at zero that KEDA wakes on a held request does not make the service unready (the
    router holds its requests); one at zero that nothing wakes does."""
    spec = with_pools(decode=KEDA | {"minReplicas": 0})
    isvc = {"metadata": META | {"generation": 1}, "spec": spec}
    pools: dict[str, dict[str, Any] | None] = {
        "prefill": deployment(1, 1),
        "decode": deployment(0, 0),
        "router": deployment(1, 1),
    }
    status = running_status(isvc, parse_spec(spec), pools, "http://llama", "now")
    ready = ready_condition(status)
    assert ready is not None and ready["status"] == "True"
    assert "decode at zero until a request wakes it" in ready["message"]
    decode = ready_condition(status, "DecodeReady")
    assert decode is not None and decode["reason"] == "ScaledToZero"
    plain = SPEC | {"decode": {"replicas": 0}}
    status = running_status(isvc, parse_spec(plain), pools, "http://llama", "now")
    assert (ready_condition(status) or {}).get("reason") == "ComponentsNotReady"


# -- against the emulated API server ------------------------------------------------------------


def declare_keda(kube: Kube) -> None:
    """Installs the ScaledObject kind, as KEDA's CRD does."""
    kube.server.declare("keda.sh", "v1alpha1", "scaledobjects", "ScaledObject", True, ("status",))
    wait_for(lambda: kube.http.get("/apis/keda.sh/v1alpha1").status_code == 200)


def run(kube: Kube, tmp_path: Path, body: Callable[[Reconciler], Awaitable[None]]) -> None:
    """Runs `body` with a reconciler connected to `kube` that asks discovery on every pass."""

    async def main() -> None:
        cluster = await connect(str(kube.server.write_kubeconfig(tmp_path / "kubeconfig")))
        try:
            reconciler = Reconciler(Api(cluster))
            reconciler._scaled_objects.recheck_seconds = 0
            await body(reconciler)
        finally:
            await cluster.close()

    asyncio.run(main())


def writes(kube: Kube, since: int) -> list[tuple[str, str]]:
    """(method, path) of the autoscaler requests that change something, after the first
    `since` requests."""
    return [
        (str(r.method).upper().rsplit(".", 1)[-1], r.url.path)
        for r in list(kube.server.handler)[since:]
        if str(r.method).upper().rsplit(".", 1)[-1] in ("PATCH", "DELETE")
        and ("/scaledobjects/" in r.url.path or "/horizontalpodautoscalers/" in r.url.path)
    ]


def test_switching_engines_deletes_the_other_autoscaler_first(kube: Kube, tmp_path: Path) -> None:
    """hpa -> keda deletes the HPA before the ScaledObject is applied (KEDA's webhook refuses a
    ScaledObject for a Deployment another HPA scales); keda -> hpa deletes the ScaledObject
    before the HPA is applied; autoscaling off deletes it too. The ScaledObject is owned by the
    service and goes with it."""
    declare_keda(kube)
    uid = kube.apply_isvc(NS, "llama", with_pools(prefill={"maxReplicas": 4}))["metadata"]["uid"]
    prefill_hpa = f"{HPAS}/llama-prefill"
    prefill_scaled = f"{SCALED_OBJECTS}/llama-prefill"

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        assert kube.names("horizontalpodautoscalers", NS) == {"llama-prefill"}
        since = len(list(kube.server.handler))
        kube.patch(ISVC, {"spec": {"prefill": {"autoscaling": {"engine": "keda"}}}})
        await reconciler.reconcile(NS, "llama")
        assert writes(kube, since) == [("DELETE", prefill_hpa), ("PATCH", prefill_scaled)]
        assert kube.names("horizontalpodautoscalers", NS) == set()
        assert kube.names("scaledobjects", NS) == {"llama-prefill"}
        since = len(list(kube.server.handler))
        kube.patch(ISVC, {"spec": {"prefill": {"autoscaling": {"engine": "hpa"}}}})
        await reconciler.reconcile(NS, "llama")
        assert writes(kube, since) == [("DELETE", prefill_scaled), ("PATCH", prefill_hpa)]
        assert kube.names("scaledobjects", NS) == set()
        kube.patch(ISVC, {"spec": {"prefill": {"autoscaling": {"engine": "keda"}}}})
        await reconciler.reconcile(NS, "llama")
        kube.patch(ISVC, {"spec": {"prefill": {"autoscaling": None}}})
        await reconciler.reconcile(NS, "llama")
        assert kube.names("scaledobjects", NS) == set()
        assert kube.names("horizontalpodautoscalers", NS) == set()
        kube.patch(ISVC, {"spec": {"prefill": {"autoscaling": KEDA}}})
        await reconciler.reconcile(NS, "llama")

    run(kube, tmp_path, body)
    scaled = kube.get(prefill_scaled)
    assert scaled is not None
    (owner,) = scaled["metadata"]["ownerReferences"]
    assert (owner["name"], owner["uid"], owner["controller"]) == ("llama", uid, True)
    check_for_keda(scaled)  # as the API server holds it
    kube.delete(ISVC)
    assert kube.names("scaledobjects", NS) == set()


def test_without_keda_the_service_says_so_and_keeps_what_ran(kube: Kube, tmp_path: Path) -> None:
    """Where the cluster does not serve ScaledObjects, a keda pool sets Ready=False with reason
    KEDANotInstalled and a Warning Event, never asks for ScaledObjects, and leaves the HPA that
    ran before; once KEDA is installed the next pass makes the ScaledObject."""
    kube.apply_isvc(NS, "llama", with_pools(decode={"maxReplicas": 4}))

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")
        kube.patch(ISVC, {"spec": {"decode": {"autoscaling": {"engine": "keda"}}}})
        await reconciler.reconcile(NS, "llama")
        status = (kube.isvc(NS, "llama") or {}).get("status") or {}
        ready = ready_condition(status)
        assert ready is not None and (ready["status"], ready["reason"]) == (
            "False",
            "KEDANotInstalled",
        )
        assert "install KEDA" in ready["message"] and "llama-decode" in ready["message"]
        events = [e for e in kube.server.objects("events", NS) if e["reason"] == "KEDANotInstalled"]
        assert [e["type"] for e in events] == ["Warning"]
        assert kube.names("horizontalpodautoscalers", NS) == {"llama-decode"}
        assert not [r for r in kube.server.handler if "/scaledobjects" in r.url.path]
        declare_keda(kube)
        await reconciler.reconcile(NS, "llama")

    run(kube, tmp_path, body)
    assert kube.names("scaledobjects", NS) == {"llama-decode"}
    assert kube.names("horizontalpodautoscalers", NS) == set()
    ready = ready_condition((kube.isvc(NS, "llama") or {}).get("status") or {})
    assert ready is not None and ready["reason"] != "KEDANotInstalled"


def test_an_hpa_asked_to_reach_zero_is_refused_with_an_event(kube: Kube, tmp_path: Path) -> None:
    """minReplicas 0 on an HPA pool: Ready=False with InvalidAutoscaling and a Warning Event,
    as every spec error."""
    kube.apply_isvc(NS, "llama", with_pools(prefill={"minReplicas": 0, "maxReplicas": 2}))

    async def body(reconciler: Reconciler) -> None:
        await reconciler.reconcile(NS, "llama")

    run(kube, tmp_path, body)
    ready = ready_condition((kube.isvc(NS, "llama") or {}).get("status") or {})
    assert ready is not None and ready["reason"] == "InvalidAutoscaling"
    assert "needs engine: keda" in ready["message"]
    events = kube.server.objects("events", NS)
    assert [e["type"] for e in events if e["reason"] == "InvalidAutoscaling"] == ["Warning"]


def test_the_operator_process_queries_its_prometheus_address(
    kube: Kube, start_operator: Callable[..., Any]
) -> None:
    """`baton operator --prometheus-address` is where its ScaledObjects query."""
    declare_keda(kube)
    start_operator("--namespace", NS, "--prometheus-address", "http://prom.ops.svc:9090")
    kube.apply_isvc(NS, "llama", with_pools(prefill=KEDA))
    scaled = wait_for(lambda: kube.get(f"{SCALED_OBJECTS}/llama-prefill"), what="ScaledObject")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["metadata"]["serverAddress"] == "http://prom.ops.svc:9090"


# -- RBAC and the chart --------------------------------------------------------------------------


KEDA_VERBS = ["get", "list", "create", "patch", "delete"]


def keda_verbs(role: dict[str, Any]) -> list[str]:
    (rule,) = [r for r in role["rules"] if "keda.sh" in r["apiGroups"]]
    assert rule["resources"] == ["scaledobjects"]
    return list(rule["verbs"])


def test_the_manifests_let_the_operator_manage_scaled_objects() -> None:
    """manifests/rbac.yaml: get, create and patch (apply), list and delete (a pool leaving
    KEDA); no watch, which would fail where KEDA is not installed."""
    path = Path(__file__).resolve().parents[2] / "manifests" / "rbac.yaml"
    role = next(
        d
        for d in yaml.safe_load_all(path.read_text())
        if d and d["kind"] == "ClusterRole" and d["metadata"]["name"] == "baton-operator"
    )
    assert keda_verbs(role) == KEDA_VERBS


@needs_helm
def test_the_chart_grants_scaled_objects_and_passes_the_prometheus_address() -> None:
    """The chart's operator role, cluster-wide or in each watched namespace, has the same rule;
    the operator gets --prometheus-address from values."""
    docs = render()
    assert keda_verbs(next(d for d in docs if d["kind"] == "ClusterRole")) == KEDA_VERBS
    scoped = render("operator.watchNamespaces={serving}")
    assert keda_verbs(next(d for d in scoped if d["kind"] == "Role")) == KEDA_VERBS
    assert operator_flags(docs).prometheus_address == DEFAULT_PROMETHEUS_ADDRESS
    told = operator_flags(render("operator.prometheusAddress=http://thanos.obs:10902"))
    assert told.prometheus_address == "http://thanos.obs:10902"
