"""Parsing an InferenceService spec: the CRD schema's defaults, every field, and the errors a
bad spec gets."""

from __future__ import annotations

import re
from typing import Any

import pytest

from baton.engine.config import is_repo_id
from baton.operator import crd
from baton.operator.spec import parse_spec
from baton.operator.validation import SpecError, defaulted_spec

MINIMAL = {"model": {"uri": "hf://acme/llama-8b"}, "image": "baton:1"}


def test_minimal_spec_gets_the_schema_defaults() -> None:
    """A spec with only a model and image gets every default the CRD declares."""
    spec = parse_spec(MINIMAL)
    assert spec.mode == "disaggregated"
    assert spec.image_pull_policy == "IfNotPresent"
    assert spec.model.served_model_name == "acme/llama-8b"
    assert spec.model.hf_repo == "acme/llama-8b" and spec.model.revision is None
    assert spec.model.cache_claim is None
    assert spec.engine.block_size == 16 and spec.engine.max_num_seqs == 256
    assert spec.engine.dtype == "auto" and spec.engine.enable_prefix_caching is True
    assert spec.engine.max_model_len is None and spec.engine.max_num_batched_tokens is None
    assert [p.role for p in spec.pools] == ["prefill", "decode"]
    assert all(p.replicas == 1 and p.tensor_parallel_size == 1 for p in spec.pools)
    assert all(p.autoscaling is None for p in spec.pools)
    assert (spec.kv_transfer.transport, spec.kv_transfer.lease_seconds) == ("auto", 30)
    assert spec.kv_transfer.load_failure_policy == "recompute"
    assert (spec.router.replicas, spec.router.policy) == (1, "prefix-aware")
    assert (spec.router.service_type, spec.router.disagg_min_tokens) == ("ClusterIP", 0)
    assert spec.router.session_affinity is None


def test_every_field_is_read() -> None:
    """Every spec field set away from its default shows up in the typed spec."""
    raw: dict[str, Any] = {
        "model": {
            "uri": "hf://acme/llama@v2",
            "servedModelName": "llama",
            "hfTokenSecret": {"name": "hf", "key": "token"},
            "cache": {"claimName": "hub-cache"},
        },
        "image": "baton:2",
        "imagePullPolicy": "Always",
        "engine": {
            "maxModelLen": 8192,
            "blockSize": 32,
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 4096,
            "dtype": "bfloat16",
            "tensorParallelSize": 2,
            "enablePrefixCaching": False,
            "extraArgs": ["--seed", "7"],
        },
        "prefill": {
            "replicas": 3,
            "resources": {"limits": {"nvidia.com/gpu": 2}},
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "env": [{"name": "A", "value": "1"}],
            "autoscaling": {"minReplicas": 2, "maxReplicas": 5},
        },
        "decode": {"replicas": 4, "autoscaling": {"maxReplicas": 9, "target": "900m"}},
        "kvTransfer": {"transport": "nixl", "leaseSeconds": 90, "loadFailurePolicy": "fail"},
        "router": {
            "replicas": 2,
            "policy": "least-load",
            "serviceType": "LoadBalancer",
            "disaggMinTokens": 128,
            "sessionAffinity": True,
        },
    }
    spec = parse_spec(raw)
    assert spec.model.revision == "v2" and spec.model.served_model_name == "llama"
    assert spec.model.hf_token_secret == ("hf", "token")
    assert spec.model.cache_claim == "hub-cache"
    assert (spec.image, spec.image_pull_policy) == ("baton:2", "Always")
    e = spec.engine
    assert (e.max_model_len, e.block_size, e.max_num_seqs) == (8192, 32, 64)
    assert (e.max_num_batched_tokens, e.dtype, e.enable_prefix_caching) == (4096, "bfloat16", False)
    assert e.extra_args == ("--seed", "7")
    prefill, decode = spec.pools
    assert (prefill.replicas, prefill.tensor_parallel_size) == (3, 2)
    assert prefill.node_selector == {"gpu": "h100"} and prefill.env == [{"name": "A", "value": "1"}]
    assert prefill.tolerations == [{"key": "gpu", "operator": "Exists"}]
    assert prefill.autoscaling is not None and prefill.autoscaling.min_replicas == 2
    assert prefill.autoscaling.metric == crd.PREFILL_METRIC
    assert prefill.autoscaling.target == crd.PREFILL_TARGET
    assert decode.autoscaling is not None and decode.autoscaling.metric == crd.DECODE_METRIC
    assert (decode.autoscaling.min_replicas, decode.autoscaling.target) == (1, "900m")
    assert spec.kv_transfer.transport == "nixl" and spec.kv_transfer.lease_seconds == 90
    assert spec.kv_transfer.load_failure_policy == "fail"
    r = spec.router
    assert (r.replicas, r.policy, r.service_type, r.disagg_min_tokens) == (
        2,
        "least-load",
        "LoadBalancer",
        128,
    )
    assert r.session_affinity is True


def test_aggregated_mode_uses_the_engine_pool() -> None:
    """Aggregated mode has one `both` pool whose fields come from `engine`."""
    spec = parse_spec(MINIMAL | {"mode": "aggregated", "engine": {"replicas": 3}})
    (pool,) = spec.pools
    assert (pool.role, pool.component, pool.replicas) == ("both", "engine", 3)


@pytest.mark.parametrize(
    ("uri", "scheme", "served", "path"),
    [
        ("pvc://weights/models/qwen-7b", "pvc", "qwen-7b", "models/qwen-7b"),
        ("pvc://weights", "pvc", "weights", ""),
        ("file:///opt/models/tiny", "file", "tiny", "/opt/models/tiny"),
    ],
)
def test_model_uri_schemes(uri: str, scheme: str, served: str, path: str) -> None:
    """pvc:// and file:// URIs give the claim or path and a served name from the last part."""
    model = parse_spec({"model": {"uri": uri}, "image": "x"}).model
    assert (model.scheme, model.served_model_name, model.path) == (scheme, served, path)


@pytest.mark.parametrize(
    ("change", "reason", "fragment"),
    [
        ({"model": {"uri": "s3://bucket/llama"}}, "UnsupportedModelURI", "hf://"),
        ({"model": {"uri": "hf://llama"}}, "InvalidModelURI", "hf://org/name"),
        ({"model": {"uri": "file://relative"}}, "InvalidModelURI", "absolute"),
        ({"image": ""}, "MissingImage", "--default-image"),
        (
            {"prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 2}},
            "TensorParallelMismatch",
            "decode tensorParallelSize 2",
        ),
        (
            {"decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
            "InvalidAutoscaling",
            "above maxReplicas",
        ),
        ({"mode": "hybrid"}, "InvalidSpec", "spec.mode must be one of"),
        ({"engine": {"blockSize": 0}}, "InvalidSpec", "spec.engine.blockSize must be at least 1"),
        ({"kvTransfer": {"leaseSeconds": "30"}}, "InvalidSpec", "must be an integer"),
        ({"decode": {"autoscaling": {}}}, "InvalidSpec", "maxReplicas is required"),
        ({"model": {}}, "InvalidSpec", "spec.model.uri is required"),
        ({"model": {"uri": "pvc://claim/../../x"}}, "InvalidModelURI", "'..' path segments"),
        ({"model": {"uri": "hf://../x"}}, "InvalidModelURI", "'..' path segments"),
        ({"model": {"uri": "file:///models/../etc"}}, "InvalidModelURI", "'..' path segments"),
        (
            {"model": {"uri": "hf://a/b", "servedModelName": "$(BATON_API_KEY)"}},
            "EnvironmentExpansion",
            "spec.model.servedModelName",
        ),
        (
            {"engine": {"extraArgs": ["--seed", "$(HF_TOKEN)"]}},
            "EnvironmentExpansion",
            "spec.engine.extraArgs",
        ),
        ({"model": {"uri": "pvc://c/$(POD_IP)"}}, "EnvironmentExpansion", "spec.model.uri"),
        # A repo id the engine would take for a path, not a repo.
        ({"model": {"uri": "hf://acme/llama 8b"}}, "InvalidModelURI", "hf://org/name"),
        ({"model": {"uri": "hf://acme/llama\n"}}, "InvalidModelURI", "hf://org/name"),
        ({"model": {"uri": "hf://-acme/llama"}}, "InvalidModelURI", "hf://org/name"),
        (
            {"model": {"uri": "pvc://Weights_1/llama"}},
            "InvalidModelURI",
            "the claim 'Weights_1' is not a PersistentVolumeClaim name",
        ),
        (
            {"model": {"uri": "hf://a/b", "cache": {"claimName": "Hub_Cache"}}},
            "InvalidModelCache",
            "spec.model.cache.claimName 'Hub_Cache' is not a PersistentVolumeClaim name",
        ),
        (
            {"model": {"uri": "hf://a/b", "cache": {"claimName": "hub-"}}},
            "InvalidModelCache",
            "is not a PersistentVolumeClaim name",
        ),
        (
            {"model": {"uri": "hf://a/b", "cache": {"claimName": "c" * 254}}},
            "InvalidModelCache",
            "at most 253",
        ),
        (
            {"model": {"uri": "hf://a/b", "cache": {"claimName": ""}}},
            "InvalidSpec",
            "spec.model.cache.claimName must not be empty",
        ),
        (
            {"model": {"uri": "hf://a/b", "cache": {}}},
            "InvalidSpec",
            "spec.model.cache.claimName is required",
        ),
        (
            {"model": {"uri": "pvc://weights/llama", "cache": {"claimName": "hub"}}},
            "InvalidModelCache",
            "a pvc:// model is read where it is",
        ),
    ],
)
def test_bad_specs_name_a_reason(change: dict[str, Any], reason: str, fragment: str) -> None:
    """Each kind of bad spec raises SpecError with its CamelCase reason and a useful message."""
    with pytest.raises(SpecError) as info:
        parse_spec(MINIMAL | change)
    assert info.value.reason == reason
    assert fragment in info.value.message


@pytest.mark.parametrize(
    "repo", ["acme/llama-8b", "Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.1-8B", "a/b_c"]
)
def test_hf_repo_ids_the_engine_takes(repo: str) -> None:
    """Every hf:// repo id the operator accepts is one the engine reads as a repo id (not as a
    path), and the served name defaults to it."""
    model = parse_spec({"model": {"uri": f"hf://{repo}@main"}, "image": "x"}).model
    assert (model.hf_repo, model.revision, model.served_model_name) == (repo, "main", repo)
    assert is_repo_id(repo)


@pytest.mark.parametrize("claim", ["hub", "model-cache", "cache.v2", "a" * 253])
def test_cache_claim_names(claim: str) -> None:
    """PersistentVolumeClaim names (DNS-1123 subdomains, up to 253 characters) are taken, and
    the CRD's pattern says the same."""
    model = {"uri": "hf://acme/llama-8b", "cache": {"claimName": claim}}
    assert parse_spec(MINIMAL | {"model": model}).model.cache_claim == claim
    schema = crd.SPEC["properties"]["model"]["properties"]["cache"]["properties"]["claimName"]
    assert re.fullmatch(schema["pattern"], claim) and len(claim) <= schema["maxLength"]


def test_default_image_fills_a_missing_image() -> None:
    """The operator's --default-image is used when the spec names no image."""
    assert parse_spec({"model": MINIMAL["model"]}, default_image="baton:op").image == "baton:op"


def test_unknown_fields_are_pruned_like_the_api_server_does() -> None:
    """Fields the schema does not know are dropped rather than rejected."""
    spec = defaulted_spec(MINIMAL | {"colour": "blue", "router": {"replicas": 2, "x": 1}})
    assert "colour" not in spec and spec["router"]["replicas"] == 2 and "x" not in spec["router"]
