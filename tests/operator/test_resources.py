"""The pure builders: which children a spec gets, and how every spec field lands in them."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from baton.engine.api.cli import add_server_args, configs_from_args
from baton.operator.resources import desired_children, service_url
from baton.operator.spec import parse_spec
from baton.operator.validation import SpecError

ISVC_META = {"name": "llama", "namespace": "serving", "uid": "uid-1", "generation": 3}


def build(spec: dict[str, Any], name: str = "llama") -> dict[tuple[str, str], dict[str, Any]]:
    isvc = {"metadata": ISVC_META | {"name": name}, "spec": spec}
    children = desired_children(isvc, parse_spec(spec))
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


BASE = {"model": {"uri": "hf://acme/llama-8b", "servedModelName": "llama"}, "image": "baton:1"}


def test_disaggregated_children() -> None:
    """A disaggregated service gets prefill, decode and router Deployments, a router Service,
    a headless Service and PDB per role, the router's RBAC and the hand-off Secret, all owned by
    the service."""
    children = build(BASE)
    assert set(children) == {
        ("Deployment", "llama-prefill"),
        ("Deployment", "llama-decode"),
        ("Deployment", "llama-router"),
        ("Service", "llama-prefill"),
        ("Service", "llama-decode"),
        ("Service", "llama"),
        ("PodDisruptionBudget", "llama-prefill"),
        ("PodDisruptionBudget", "llama-decode"),
        ("PodDisruptionBudget", "llama-router"),
        ("ServiceAccount", "llama-router"),
        ("Role", "llama-router"),
        ("RoleBinding", "llama-router"),
        ("NetworkPolicy", "llama-engines"),
        ("Secret", "llama-kv-secret"),
    }
    assert "data" not in children[("Secret", "llama-kv-secret")]  # filled in once, on creation
    for child in children.values():
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "baton.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "llama",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["namespace"] == "serving"


def test_aggregated_children_and_autoscaling() -> None:
    """An aggregated service gets one engine pool; autoscaling adds an HPA and leaves the
    Deployment's replicas to it."""
    spec = BASE | {"mode": "aggregated", "engine": {"autoscaling": {"maxReplicas": 6}}}
    children = build(spec)
    assert {name for kind, name in children if kind == "Deployment"} == {
        "llama-engine",
        "llama-router",
    }
    engine = children[("Deployment", "llama-engine")]
    assert "replicas" not in engine["spec"]
    assert flag(container(engine)["args"], "--role") == "both"
    hpa = children[("HorizontalPodAutoscaler", "llama-engine")]["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "llama-engine",
    }
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 6)
    assert hpa["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "vllm:num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "4"},
            },
        }
    ]


def test_labels_selectors_and_headless_services() -> None:
    """Engine pods and their headless Services carry the discovery labels and the served model;
    selectors use only the stable labels."""
    children = build(BASE)
    decode = children[("Deployment", "llama-decode")]
    pod_labels = decode["spec"]["template"]["metadata"]["labels"]
    revision = pod_labels.pop("baton.dev/revision")  # tests/operator/test_rollout.py
    assert len(revision) == 10
    assert pod_labels == {
        "app.kubernetes.io/name": "baton",
        "app.kubernetes.io/instance": "llama",
        "app.kubernetes.io/component": "decode",
        "app.kubernetes.io/managed-by": "baton-operator",
        "baton.dev/inference-service": "llama",
        "baton.dev/role": "decode",
    }
    selector = {
        "app.kubernetes.io/name": "baton",
        "app.kubernetes.io/instance": "llama",
        "app.kubernetes.io/component": "decode",
    }
    assert decode["spec"]["selector"] == {"matchLabels": selector}
    annotations = decode["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations["baton.dev/served-model-name"] == "llama"
    headless = children[("Service", "llama-decode")]
    assert headless["metadata"]["labels"] == pod_labels | {"baton.dev/gateway": "true"}
    assert headless["metadata"]["annotations"] == {"baton.dev/served-model-name": "llama"}
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"] == selector
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == {"http": 8000, "kv": 14579}
    router_pods = children[("Deployment", "llama-router")]["spec"]["template"]["metadata"]
    assert "baton.dev/role" not in router_pods["labels"]


def test_engine_command_line_has_every_engine_field() -> None:
    """Engine, KV transfer and model fields become `baton engine` flags."""
    spec = BASE | {
        "engine": {
            "maxModelLen": 8192,
            "blockSize": 32,
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 2048,
            "dtype": "bfloat16",
            "tensorParallelSize": 2,
            "enablePrefixCaching": False,
            "extraArgs": ["--seed", "7"],
        },
        "kvTransfer": {"transport": "nixl", "leaseSeconds": 45, "loadFailurePolicy": "fail"},
    }
    engine = container(build(spec)[("Deployment", "llama-prefill")])
    args = engine["args"]
    assert engine["command"] == ["baton"] and args[0] == "engine"
    expected = {
        "--model": "acme/llama-8b",
        "--download-dir": "/models/hub",
        "--served-model-name": "llama",
        "--host": "0.0.0.0",
        "--port": "8000",
        "--role": "prefill",
        "--kv-transport": "nixl",
        "--kv-port": "14579",
        "--kv-host": "$(POD_IP)",
        "--kv-lease-seconds": "45",
        "--kv-load-failure-policy": "fail",
        "--kv-secret-file": "/etc/baton/kv-secret/keys",
        "--max-model-len": "8192",
        "--block-size": "32",
        "--max-num-seqs": "64",
        "--max-num-batched-tokens": "2048",
        "--dtype": "bfloat16",
        "--tensor-parallel-size": "2",
    }
    assert {name: flag(args, name) for name in expected} == expected
    assert "--no-enable-prefix-caching" in args and args[-2:] == ["--seed", "7"]
    assert engine["env"][0] == {
        "name": "POD_IP",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    }
    assert "--max-model-len" not in container(build(BASE)[("Deployment", "llama-prefill")])["args"]


def test_pool_fields_reach_the_pod() -> None:
    """Replicas, resources, node selector, tolerations and env land in the pool's pods, and a
    GPU request becomes tensorParallelSize GPUs."""
    pool = {
        "replicas": 3,
        "tensorParallelSize": 2,
        "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "40Gi"}, "requests": {"cpu": "8"}},
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
    }
    spec = BASE | {"prefill": pool, "decode": {"tensorParallelSize": 2}}
    deployment = build(spec)[("Deployment", "llama-prefill")]
    pod = deployment["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert engine["resources"] == {
        "limits": {"nvidia.com/gpu": 2, "memory": "40Gi"},
        "requests": {"cpu": "8"},
    }
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == pool["tolerations"]
    assert engine["env"][-1:] == [{"name": "NCCL_DEBUG", "value": "INFO"}]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    # Each rank serves its KV shard on its own port (rank r on the KV port + r).
    assert [(p["name"], p["containerPort"]) for p in engine["ports"]] == [
        ("http", 8000),
        ("kv", 14579),
        ("kv-1", 14580),
        ("kv-events", 5557),  # the prefix cache's KV events, and their replay
        ("kv-replay", 5558),
    ]
    args = engine["args"]
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://$(POD_IP):5557"
    assert events["topic"] == "kv@$(POD_IP)@llama"  # llm-d's topic: pod and model
    decode = container(build(spec)[("Deployment", "llama-decode")])
    assert "nvidia.com/gpu" not in decode["resources"].get("limits", {})  # asked for none


def test_probes_drain_and_grace_period() -> None:
    """Engines get /health probes, a preStop pause and a grace period that covers the drain,
    and on prefill (which holds the leases) the KV lease too."""
    spec = BASE | {"kvTransfer": {"leaseSeconds": 60}}
    deployment = build(spec)[("Deployment", "llama-decode")]
    pod = deployment["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= 10 + 120
    prefill = build(spec)[("Deployment", "llama-prefill")]["spec"]["template"]["spec"]
    assert prefill["terminationGracePeriodSeconds"] >= 10 + 120 + 60


def engine_parse(pod: dict[str, Any]) -> tuple[Any, Any]:
    """What `baton engine` makes of the engine container's args: (EngineArgs, ServerConfig)."""
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return configs_from_args(parser.parse_args(pod["containers"][0]["args"][1:]))


def test_hf_models_download_in_the_engine() -> None:
    """hf:// runs `baton engine --model org/name --revision R --download-dir /models/hub` with
    HF_TOKEN from the Secret on the engine (no init container), the served name as before, into
    a read-write emptyDir at /models without a cache claim; each pod has an hour to download."""
    hf = BASE | {"model": {"uri": "hf://acme/llama@v2", "hfTokenSecret": {"name": "hf"}}}
    for name in ("llama-prefill", "llama-decode"):
        pod = build(hf)[("Deployment", name)]["spec"]["template"]["spec"]
        assert "initContainers" not in pod
        engine = pod["containers"][0]
        args, server = engine_parse(pod)
        assert (args.model, args.revision, args.download_dir) == ("acme/llama", "v2", "/models/hub")
        assert server.served_model_name == "acme/llama"  # the repo id, as the init container's
        token = {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
        assert {"name": "HF_TOKEN", "valueFrom": token} in engine["env"]
        assert {"name": "model", "emptyDir": {}} in pod["volumes"]
        assert {"name": "model", "mountPath": "/models"} in engine["volumeMounts"]  # read-write
        startup = engine["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] == 3600
    # No revision: none passed (the engine takes the repo's main); the served name is kept.
    pod = build(BASE)[("Deployment", "llama-decode")]["spec"]["template"]["spec"]
    args, server = engine_parse(pod)
    assert "--revision" not in pod["containers"][0]["args"] and args.revision is None
    assert (args.model, server.served_model_name) == ("acme/llama-8b", "llama")
    assert not any(e["name"] == "HF_TOKEN" for e in pod["containers"][0]["env"])


def test_an_hf_cache_claim_is_shared_by_every_engine_pod() -> None:
    """With spec.model.cache every engine pod of every pool mounts the claim read-write at
    /models, where the engine's --download-dir is; the router does not mount it."""
    spec = BASE | {"model": {"uri": "hf://acme/llama-8b", "cache": {"claimName": "hub-cache"}}}
    children = build(spec)
    for name in ("llama-prefill", "llama-decode"):
        pod = children[("Deployment", name)]["spec"]["template"]["spec"]
        claim = {"name": "model", "persistentVolumeClaim": {"claimName": "hub-cache"}}
        assert claim in pod["volumes"]
        engine = pod["containers"][0]
        (mount,) = [m for m in engine["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": "/models"}
        assert engine_parse(pod)[0].download_dir.startswith(mount["mountPath"] + "/")
    aggregated = build(spec | {"mode": "aggregated"})[("Deployment", "llama-engine")]
    assert claim in aggregated["spec"]["template"]["spec"]["volumes"]
    router = children[("Deployment", "llama-router")]["spec"]["template"]["spec"]
    assert all("persistentVolumeClaim" not in v for v in router["volumes"])


def test_pvc_and_file_models_stay_where_they_are() -> None:
    """pvc:// mounts the claim read-only at /models and passes the folder in it; file:// uses
    the image's path as it is; neither gets --download-dir, HF_TOKEN or the hour to start."""
    pvc = BASE | {"model": {"uri": "pvc://weights/llama-8b", "hfTokenSecret": {"name": "hf"}}}
    pod = build(pvc)[("Deployment", "llama-decode")]["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    claim = {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    assert claim in pod["volumes"]
    engine = pod["containers"][0]
    mount = {"name": "model", "mountPath": "/models", "readOnly": True}
    assert mount in engine["volumeMounts"]
    assert flag(engine["args"], "--model") == "/models/llama-8b"
    assert not any(e["name"] == "HF_TOKEN" for e in engine["env"])
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 900

    local = BASE | {"model": {"uri": "file:///opt/llama"}}
    pod = build(local)[("Deployment", "llama-decode")]["spec"]["template"]["spec"]
    # No model volume: only scratch and the hand-off secret.
    assert [v["name"] for v in pod["volumes"]] == ["tmp", "cache", "kv-secret"]
    assert "initContainers" not in pod
    assert flag(pod["containers"][0]["args"], "--model") == "/opt/llama"
    for built in (pvc, local):
        pod = build(built)[("Deployment", "llama-prefill")]["spec"]["template"]["spec"]
        assert "--download-dir" not in pod["containers"][0]["args"]


def test_router_children() -> None:
    """The router runs Kubernetes discovery of its own engines with the spec's policy, behind a
    Service of the spec's type, with a Role that only reads EndpointSlices and Services."""
    spec = BASE | {
        "router": {
            "replicas": 2,
            "policy": "least-load",
            "serviceType": "LoadBalancer",
            "disaggMinTokens": 64,
            "sessionAffinity": False,
            "cacheSaltFrom": "header",
            "cacheSaltHeader": "x-team",
        },
        "imagePullPolicy": "Always",
    }
    children = build(spec)
    router = children[("Deployment", "llama-router")]
    pod = router["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert router["spec"]["replicas"] == 2 and pod["serviceAccountName"] == "llama-router"
    assert args[0] == "router" and flag(args, "--discovery") == "kubernetes"
    assert flag(args, "--namespace") == "serving"
    assert flag(args, "--selector") == "baton.dev/inference-service=llama"
    assert flag(args, "--policy") == "least-load" and flag(args, "--disagg-min-tokens") == "64"
    assert "--no-session-affinity" in args
    # Tenants' prefix caches kept apart by the router, from the header the spec names.
    assert (
        flag(args, "--cache-salt-from") == "header"
        and flag(args, "--cache-salt-header") == "x-team"
    )
    default = container(build(BASE)[("Deployment", "llama-router")])["args"]
    assert flag(default, "--cache-salt-from") == "client"  # the client's own, as vLLM
    assert pod["containers"][0]["imagePullPolicy"] == "Always"
    assert children[("Service", "llama")]["spec"]["type"] == "LoadBalancer"
    rules = children[("Role", "llama-router")]["rules"]
    assert {(r["apiGroups"][0], r["resources"][0]) for r in rules} == {
        ("discovery.k8s.io", "endpointslices"),
        ("", "services"),
    }
    assert all(r["verbs"] == ["get", "list", "watch"] for r in rules)
    binding = children[("RoleBinding", "llama-router")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "llama-router", "namespace": "serving"}
    ]


def test_names_too_long_for_children_are_refused() -> None:
    """A name that would make child Service names longer than 63 characters is a bad spec."""
    with pytest.raises(SpecError) as info:
        build(BASE, name="x" * 56)
    assert info.value.reason == "NameTooLong"


def test_service_url_prefers_the_load_balancer() -> None:
    """The URL is the in-cluster DNS name until a load balancer reports its address."""
    isvc = {"metadata": ISVC_META}
    assert service_url(isvc, None) == "http://llama.serving.svc"
    lb = {"status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}}}
    assert service_url(isvc, lb) == "http://203.0.113.7"


def test_gpu_pools_run_the_cuda_image_unless_the_spec_names_one() -> None:
    """With no spec.image, a pool that asks for nvidia.com/gpu runs the operator's
    --default-gpu-image (the Dockerfile's cuda target) and everything else the default image;
    a spec.image is used everywhere; without a GPU image the default image serves all."""
    gpu = {"resources": {"limits": {"nvidia.com/gpu": 1}}}
    spec = {"model": BASE["model"], "prefill": gpu, "decode": gpu | {"replicas": 1}}
    cpu_decode = {"model": BASE["model"], "prefill": gpu}

    def images(raw: dict[str, Any], *defaults: str) -> dict[str, str]:
        isvc = {"metadata": ISVC_META | {"name": "llama"}, "spec": raw}
        children = desired_children(isvc, parse_spec(raw, *defaults))
        return {
            c["metadata"]["name"]: container(c)["image"]
            for c in children
            if c["kind"] == "Deployment"
        }

    assert images(spec, "baton:2", "baton:2-cuda") == {
        "llama-prefill": "baton:2-cuda",
        "llama-decode": "baton:2-cuda",
        "llama-router": "baton:2",
    }
    assert images(cpu_decode, "baton:2", "baton:2-cuda")["llama-decode"] == "baton:2"
    assert set(images(spec | {"image": "mine:1"}, "baton:2", "baton:2-cuda").values()) == {"mine:1"}
    assert set(images(spec, "baton:2").values()) == {"baton:2"}
