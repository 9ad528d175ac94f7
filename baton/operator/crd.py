"""The `InferenceService` custom resource definition: the one source of truth for its OpenAPI v3
schema (with defaults, enums and bounds), printer columns and names. `manifests/crd.yaml` and the
Helm chart's copy are generated from `crd_manifest()`; the operator applies the same schema's
defaults and checks itself (`validation.py`), so a spec means the same with or without an API
server that enforces the schema.
"""

from __future__ import annotations

from typing import Any

GROUP = "baton.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["bisvc"]

# The metrics the HPAs scale on when a pool's autoscaling names none, chosen by
# bench/autoscaling_metrics.py (docs/autoscaling.md): a prefill engine's mean time to first token
# (the adapter's rate(_sum) / rate(_count) of the histogram) tracks clients' TTFT, while its
# waiting requests read 0 even when saturated (each step takes every request that arrived);
# KV cache space is what a decode pool is short of (its ITL tracks clients' as closely).
PREFILL_METRIC = "vllm:time_to_first_token_seconds_mean"
DECODE_METRIC = "vllm:kv_cache_usage_perc"
PREFILL_TARGET = "1"  # seconds of mean TTFT per prefill pod
DECODE_TARGET = "800m"
# An aggregated engine's steps mix decodes with prefills, so requests do wait in its queue: it
# keeps scaling on them (the measurement above was of disaggregated pools).
AGGREGATED_METRIC = "vllm:num_requests_waiting"
AGGREGATED_TARGET = "4"
# How long an in-flight request gets after SIGTERM (`spec.drain.timeoutSeconds`). An hour is
# the bound: past it a rolling update of a few dozen pods, or a node drain, can take a day.
DEFAULT_DRAIN_SECONDS = 120
MAX_DRAIN_SECONDS = 3600
# A PersistentVolumeClaim's name is a DNS-1123 subdomain (`spec.model.cache.claimName`).
CLAIM_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
CLAIM_NAME_MAX = 253

Schema = dict[str, Any]


def _int(default: int | None = None, minimum: int = 0, maximum: int | None = None) -> Schema:
    schema: Schema = {"type": "integer", "minimum": minimum}
    if maximum is not None:
        schema["maximum"] = maximum
    if default is not None:
        schema["default"] = default
    return schema


def _str(description: str, default: str | None = None, enum: list[str] | None = None) -> Schema:
    schema: Schema = {"type": "string", "description": description}
    if default is not None:
        schema["default"] = default
    if enum is not None:
        schema["enum"] = enum
    return schema


def _obj(properties: dict[str, Schema], description: str, **extra: Any) -> Schema:
    return {"type": "object", "description": description, "properties": properties, **extra}


QUANTITY: Schema = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
}
# Kubernetes' own types that the operator copies into pods as they are.
RESOURCES: Schema = _obj(
    {
        "limits": {"type": "object", "additionalProperties": QUANTITY},
        "requests": {"type": "object", "additionalProperties": QUANTITY},
    },
    "Container resources (requests and limits). When they ask for nvidia.com/gpu, the engine "
    "asks for tensorParallelSize GPUs.",
)
NODE_SELECTOR: Schema = {
    "type": "object",
    "description": "Node labels the pods must match.",
    "additionalProperties": {"type": "string"},
}
TOLERATIONS: Schema = {
    "type": "array",
    "description": "Pod tolerations, as in a pod spec.",
    "items": _obj(
        {
            "key": {"type": "string"},
            "operator": _str("How key and value match.", enum=["Exists", "Equal"]),
            "value": {"type": "string"},
            "effect": _str(
                "Taint effect to tolerate; empty matches all.",
                enum=["NoSchedule", "PreferNoSchedule", "NoExecute"],
            ),
            "tolerationSeconds": {"type": "integer"},
        },
        "One toleration.",
    ),
}
ENV: Schema = {
    "type": "array",
    "description": "Extra environment variables, as in a container spec.",
    "items": _obj(
        {
            "name": {"type": "string", "minLength": 1},
            "value": {"type": "string"},
            "valueFrom": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
        "One variable.",
        required=["name"],
    ),
}


def _autoscaling(metric: str, target: str) -> Schema:
    return _obj(
        {
            "engine": _str(
                "What scales the pool: an autoscaling/v2 HPA, or a KEDA ScaledObject (needs "
                "KEDA in the cluster; the only one that scales to zero).",
                "hpa",
                ["hpa", "keda"],
            ),
            "minReplicas": {
                **_int(1, maximum=1000),
                "description": "0 (scale to zero: the first request the router holds wakes "
                "the pool) only with engine keda.",
            },
            "maxReplicas": _int(minimum=1, maximum=1000),
            "metric": _str("Engine metric averaged over the pool's pods.", default=metric),
            "target": {
                **QUANTITY,
                "description": "Average value per pod to hold the metric at (a quantity).",
                "default": target,
            },
            "prometheusAddress": _str(
                "The Prometheus a keda engine's ScaledObject queries; default: the operator's "
                "--prometheus-address."
            ),
        },
        "Scale the pool with an HPA or a KEDA ScaledObject; the operator then leaves replicas "
        "to it.",
        required=["maxReplicas"],
    )


def _pool_properties(metric: str, target: str) -> dict[str, Schema]:
    return {
        "replicas": _int(1, maximum=1000),
        "tensorParallelSize": {
            **_int(minimum=1, maximum=64),
            "description": "Overrides engine.tensorParallelSize for this pool.",
        },
        "resources": RESOURCES,
        "nodeSelector": NODE_SELECTOR,
        "tolerations": TOLERATIONS,
        "env": ENV,
        "autoscaling": _autoscaling(metric, target),
    }


def _planner_pool(role: str) -> Schema:
    return _obj(
        {
            "minReplicas": _int(1, minimum=1, maximum=1000),
            "maxReplicas": _int(minimum=1, maximum=1000),
        },
        f"The bounds the planner keeps the {role} pool within.",
        required=["maxReplicas"],
    )


def _seconds(description: str) -> Schema:
    return {
        "type": "number",
        "description": description,
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 3600,
    }


PLANNER: Schema = _obj(
    {
        "enabled": {
            "type": "boolean",
            "default": True,
            "description": "false keeps the settings but lets the pools' own replicas and "
            "autoscaling size them.",
        },
        "ttftSeconds": _seconds(
            "The p90 time to first token (end to end) the planner sizes the prefill pool for."
        ),
        "itlSeconds": _seconds("The mean inter-token latency the planner sizes decode for."),
        "intervalSeconds": {
            **_int(30, minimum=1, maximum=3600),
            "description": "Seconds between two of the planner's decisions.",
        },
        "cooldownSeconds": {
            **_int(120, maximum=3600),
            "description": "Seconds a lower count must hold before a pool scales down.",
        },
        "prefill": _planner_pool("prefill"),
        "decode": _planner_pool("decode"),
    },
    "The SLO planner: it sets the prefill and decode pools' replicas from their load and these "
    "latency targets (disaggregated services, pools without autoscaling).",
    required=["ttftSeconds", "itlSeconds", "prefill", "decode"],
)

_POOL = "One pool of engine pods."
ENGINE: Schema = _obj(
    {
        # In aggregated mode `engine` is also the pool of `role both` engines; its
        # tensorParallelSize below (with a default) is the service-wide one.
        **_pool_properties(AGGREGATED_METRIC, AGGREGATED_TARGET),
        "maxModelLen": {**_int(minimum=1), "description": "Longest sequence (prompt + output)."},
        "blockSize": _int(16, minimum=1, maximum=1024),
        "maxNumSeqs": _int(256, minimum=1, maximum=65536),
        "maxNumBatchedTokens": {**_int(minimum=1), "description": "Token budget per step."},
        "dtype": _str(
            "Weights and activations.", "auto", ["auto", "float16", "bfloat16", "float32"]
        ),
        "tensorParallelSize": _int(1, minimum=1, maximum=64),
        "enablePrefixCaching": {"type": "boolean", "default": True},
        "extraArgs": {
            "type": "array",
            "description": "More `baton engine` arguments, appended as they are.",
            "items": {"type": "string"},
        },
    },
    "Engine arguments shared by every engine; in aggregated mode also the one engine pool.",
    default={},
)

SPEC: Schema = _obj(
    {
        "model": _obj(
            {
                "uri": _str("hf://org/name[@revision], pvc://claim/path or file:///path."),
                "servedModelName": _str("Name clients send as `model`; default from the URI."),
                "hfTokenSecret": _obj(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "key": _str("Key in the Secret.", "HF_TOKEN"),
                    },
                    "Secret holding HF_TOKEN for hf:// downloads.",
                    required=["name"],
                ),
                "cache": _obj(
                    {
                        "claimName": {
                            **_str("An existing ReadWriteMany PersistentVolumeClaim."),
                            "minLength": 1,
                            "maxLength": CLAIM_NAME_MAX,
                            "pattern": CLAIM_NAME,
                        },
                    },
                    "hf:// only: a shared volume for the Hugging Face cache, mounted read-write "
                    "at /models in every engine pod, so the first download serves every replica "
                    "and restart; default: an emptyDir per pod.",
                    required=["claimName"],
                ),
            },
            "The model to serve.",
            required=["uri"],
        ),
        "apiKeySecret": _obj(
            {
                "name": {"type": "string", "minLength": 1},
                "key": _str("Key in the Secret.", "api-key"),
            },
            "Secret holding the API key: engines and the router then require it as a bearer "
            "token, and the router sends it to the engines.",
            required=["name"],
        ),
        "image": _str(
            "Image with `baton` for every pool; default: the operator's --default-image, and "
            "its --default-gpu-image for pools that ask for nvidia.com/gpu."
        ),
        "imagePullPolicy": _str("", "IfNotPresent", ["Always", "IfNotPresent", "Never"]),
        "mode": _str(
            "disaggregated: prefill and decode pools; aggregated: one engine pool.",
            "disaggregated",
            ["disaggregated", "aggregated"],
        ),
        "engine": ENGINE,
        "prefill": _obj(_pool_properties(PREFILL_METRIC, PREFILL_TARGET), _POOL, default={}),
        "decode": _obj(_pool_properties(DECODE_METRIC, DECODE_TARGET), _POOL, default={}),
        "planner": PLANNER,
        "kvTransfer": _obj(
            {
                "transport": _str(
                    "KV block transport. auto: NIXL where the engine's image has it and it "
                    "serves the KV cache's memory, TCP otherwise; nixl: NIXL or the engine "
                    "fails to start.",
                    "auto",
                    ["auto", "tcp", "nixl"],
                ),
                "leaseSeconds": _int(30, minimum=1, maximum=3600),
                "loadFailurePolicy": _str(
                    "What decode does when a pull fails.", "recompute", ["recompute", "fail"]
                ),
            },
            "How decode engines pull KV blocks from prefill engines.",
            default={},
        ),
        "drain": _obj(
            {
                "timeoutSeconds": {
                    **_int(DEFAULT_DRAIN_SECONDS, maximum=MAX_DRAIN_SECONDS),
                    "description": "Seconds an in-flight request gets to finish once a pod is "
                    "told to stop; the engines' --shutdown-timeout and the pods' "
                    "terminationGracePeriodSeconds follow from it (and, for prefill, the KV "
                    "lease).",
                },
            },
            "How engine and router pods stop.",
            default={},
        ),
        "router": _obj(
            {
                "replicas": _int(1, maximum=100),
                "policy": _str(
                    "Engine choice.",
                    "prefix-aware",
                    ["round-robin", "least-load", "prefix-aware"],
                ),
                "sessionAffinity": {
                    "type": "boolean",
                    "description": "Send requests with one x-session-id to one engine "
                    "(default: the router's).",
                },
                "cacheSaltFrom": _str(
                    "Who sets each request's cache_salt (the prefix-cache scope): the client, or "
                    "the router per tenant from the API key or the cacheSaltHeader header.",
                    "client",
                    ["client", "api-key", "header"],
                ),
                "cacheSaltHeader": {
                    **_str("The tenant header for cacheSaltFrom: header.", "x-tenant-id"),
                    "pattern": "^[A-Za-z0-9-]+$",
                    "maxLength": 64,
                },
                "serviceType": _str("", "ClusterIP", ["ClusterIP", "NodePort", "LoadBalancer"]),
                "disaggMinTokens": {
                    **_int(0),
                    "description": "Shorter prompts skip prefill and go to decode directly.",
                },
                "resources": RESOURCES,
            },
            "The router in front of the engines.",
            default={},
        ),
    },
    "What to serve and how.",
    required=["model"],
)

POOL_STATUS: Schema = _obj(
    {
        "desiredReplicas": {"type": "integer"},
        "readyReplicas": {"type": "integer"},
        "summary": {"type": "string"},
        "replicas": {"type": "integer", "description": "Pods of any revision."},
        "updatedReplicas": {"type": "integer", "description": "Pods of the current template."},
        "availableReplicas": {"type": "integer"},
        "rolloutComplete": {
            "type": "boolean",
            "description": "As `kubectl rollout status` decides: the Deployment saw the current "
            "generation and every pod is updated and available.",
        },
        "revision": {"type": "string", "description": "The pods' baton.dev/revision label."},
    },
    "Replicas of one Deployment.",
)
KV_PATH_STATUS: Schema = _obj(
    {
        "transport": {
            "type": "string",
            "description": "The transport the decode engine's /health says it uses.",
        },
        "requestedTransport": {"type": "string", "description": "spec.kvTransfer.transport."},
        "succeeded": {"type": "boolean"},
        "bytes": {"type": "integer", "description": "KV bytes the canary's pull moved."},
        "gbPerSecond": {
            "type": "number",
            "description": "Bytes over seconds of the pull (the decode engine's metrics).",
        },
        "latencyMs": {"type": "number", "description": "Time of the pull (else of step 2)."},
        "lastCheckTime": {"type": "string", "format": "date-time"},
        "consecutiveFailures": {"type": "integer"},
        "prefillEngine": {"type": "string", "description": "host:port of the prefill engine."},
        "decodeEngine": {"type": "string", "description": "host:port of the decode engine."},
    },
    "The last canary KV hand-off between a ready prefill and a ready decode engine.",
)
PLANNER_STATUS: Schema = _obj(
    {
        "prefill": {"type": "integer", "description": "Prefill replicas the planner set."},
        "decode": {"type": "integer", "description": "Decode replicas the planner set."},
        "reason": {"type": "string", "description": "Why, or why it held the counts."},
        "lastDecisionTime": {"type": "string", "format": "date-time"},
        "observed": _obj(
            {
                "requestsPerSecond": {"type": "number"},
                "ttftP90Seconds": {"type": "number", "description": "End to end, the router's."},
                "itlSeconds": {"type": "number", "description": "Mean, the decode engines'."},
            },
            "What the planner saw in its last interval.",
        ),
    },
    "The SLO planner's last decision (spec.planner).",
)
STATUS: Schema = _obj(
    {
        "observedGeneration": {"type": "integer"},
        "mode": {"type": "string"},
        "url": {"type": "string"},
        "revision": {
            "type": "string",
            "description": "The engine pods' baton.dev/revision label the spec asks for.",
        },
        "gatewayUrl": {
            "type": "string",
            "description": "The cluster gateway, which serves this model too (by its name).",
        },
        "prefill": POOL_STATUS,
        "decode": POOL_STATUS,
        "router": POOL_STATUS,
        "kvPath": KV_PATH_STATUS,
        "planner": PLANNER_STATUS,
        "conditions": {
            "type": "array",
            "items": _obj(
                {
                    "type": {"type": "string"},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                    "observedGeneration": {"type": "integer"},
                },
                "One condition.",
                required=["type", "status"],
            ),
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    },
    "What runs, as the operator last saw it.",
)

PRINTER_COLUMNS = [
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    },
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary"},
    {"name": "URL", "type": "string", "jsonPath": ".status.url"},
    {"name": "Revision", "type": "string", "jsonPath": ".status.revision", "priority": 1},
    {
        "name": "KVPath",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="KVPathReady")].reason',
        "priority": 1,
    },
    {
        "name": "Rollout",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="RolloutComplete")].reason',
        "priority": 1,
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition object, as written to `manifests/crd.yaml`."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": _obj(
                            {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": SPEC,
                                "status": STATUS,
                            },
                            "An LLM served by prefill and decode engine pools behind a router.",
                            required=["spec"],
                        )
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    """`manifests/crd.yaml` and the chart's `crds/inferenceservices.yaml`, byte for byte."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # the schema reuses sub-schemas; spell each out, no &anchors

    header = "# Generated by `python -m baton.operator.crd`; edit baton/operator/crd.py instead.\n"
    return header + yaml.dump(crd_manifest(), Dumper=Dumper, sort_keys=False, width=100)


if __name__ == "__main__":
    import sys

    sys.stdout.write(crd_yaml())
