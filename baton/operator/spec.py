"""The typed view of an `InferenceService` spec: frozen dataclasses built by `parse_spec`, which
applies the CRD schema (defaults, bounds) and the checks a schema cannot express (model URI,
tensor-parallel layouts, image, autoscaling bounds and engines, the planner's preconditions),
raising `SpecError` with a CamelCase reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from baton.operator.crd import CLAIM_NAME, CLAIM_NAME_MAX
from baton.operator.validation import SpecError, defaulted_spec
from baton.roles import Role

Mode = Literal["disaggregated", "aggregated"]
MODEL_SCHEMES = ("hf", "pvc", "file")
GPU = "nvidia.com/gpu"  # the extended resource of NVIDIA's device plugin


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from and how clients name the model."""

    uri: str
    scheme: Literal["hf", "pvc", "file"]
    served_model_name: str
    hf_repo: str | None = None  # "org/name" for hf://
    revision: str | None = None  # hf:// revision after "@"
    pvc_claim: str | None = None  # claim name for pvc://
    path: str = ""  # path inside the claim (pvc://) or the image (file://)
    hf_token_secret: tuple[str, str] | None = None  # (Secret name, key)
    # hf:// only: an existing ReadWriteMany claim for the Hugging Face cache, shared by every
    # engine pod (`spec.model.cache.claimName`); None: each pod downloads into its own emptyDir
    cache_claim: str | None = None


@dataclass(frozen=True)
class EngineArgs:
    """`baton engine` arguments shared by every engine pod of the service."""

    max_model_len: int | None
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    dtype: str
    enable_prefix_caching: bool
    extra_args: tuple[str, ...]


@dataclass(frozen=True)
class Autoscaling:
    """What scales one pool: an HPA, or a KEDA ScaledObject that queries Prometheus, on one
    engine metric averaged over the pool's pods. Only KEDA scales to zero (`min_replicas` 0): an
    HPA never moves a Deployment at zero replicas."""

    min_replicas: int
    max_replicas: int
    metric: str
    target: str  # a Kubernetes quantity, e.g. "4" or "800m"
    engine: Literal["hpa", "keda"] = "hpa"
    prometheus_address: str | None = None  # keda only; None: the operator's --prometheus-address

    @property
    def threshold(self) -> str:
        """`target` as the plain decimal a KEDA threshold is ("800m" is "0.8")."""
        return format(quantity_value(self.target).normalize(), "f")


@dataclass(frozen=True)
class Pool:
    """One Deployment of engines with one role."""

    role: Role
    replicas: int
    tensor_parallel_size: int
    resources: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    env: list[dict[str, Any]] = field(default_factory=list)
    autoscaling: Autoscaling | None = None

    @property
    def component(self) -> str:
        """The `app.kubernetes.io/component` label and the name suffix of its children."""
        return "engine" if self.role == "both" else self.role

    @property
    def moves_kv(self) -> bool:
        """Whether the pool's engines hand KV to other engines. Only prefill and decode pools
        do: an aggregated pool serves alone, so it runs no KV server (no port to fence, no
        hand-off secret to hold)."""
        return self.role != "both"

    @property
    def uses_gpus(self) -> bool:
        """Whether the pool's resources ask for NVIDIA GPUs."""
        return any(GPU in self.resources.get(part, {}) for part in ("limits", "requests"))


@dataclass(frozen=True)
class PlannerSpec:
    """The SLO planner's targets and bounds (`spec.planner`). The planner sets both pools'
    replicas itself, so the operator applies neither their replicas nor an autoscaler."""

    ttft_seconds: float  # p90 time to first token, end to end, the prefill pool is sized for
    itl_seconds: float  # mean inter-token latency the decode pool is sized for
    interval_seconds: int  # between two decisions
    cooldown_seconds: int  # how long a lower count must hold before a pool scales down
    prefill_min: int
    prefill_max: int
    decode_min: int
    decode_max: int

    def __post_init__(self) -> None:
        for role, low, high in (
            ("prefill", self.prefill_min, self.prefill_max),
            ("decode", self.decode_min, self.decode_max),
        ):
            if low > high:
                raise SpecError(
                    "InvalidPlanner",
                    f"spec.planner.{role}.minReplicas {low} is above maxReplicas {high}",
                )


@dataclass(frozen=True)
class KVTransfer:
    transport: Literal["auto", "tcp", "nixl"]
    lease_seconds: int
    load_failure_policy: Literal["recompute", "fail"]


@dataclass(frozen=True)
class Drain:
    """How pods stop: `timeout_seconds` is what an in-flight request gets after SIGTERM."""

    timeout_seconds: int


@dataclass(frozen=True)
class RouterSpec:
    replicas: int
    policy: str
    service_type: str
    disagg_min_tokens: int
    session_affinity: bool | None = None  # None: the router's default
    resources: dict[str, Any] = field(default_factory=dict)
    cache_salt_from: str = "client"  # the router's --cache-salt-from
    cache_salt_header: str = "x-tenant-id"


@dataclass(frozen=True)
class InferenceServiceSpec:
    """Everything the builders need, defaults applied and checked."""

    model: ModelSource
    image: str
    image_pull_policy: str
    mode: Mode
    engine: EngineArgs
    pools: tuple[Pool, ...]  # (prefill, decode) or (engine,) when aggregated
    kv_transfer: KVTransfer
    router: RouterSpec
    drain: Drain
    api_key_secret: tuple[str, str] | None = None  # (Secret name, key)
    planner: PlannerSpec | None = None  # None: no planner (absent or not enabled)
    gpu_image: str = ""  # for pools that ask for GPUs; "" means `image`

    def image_for(self, pool: Pool) -> str:
        """The image of `pool`'s engines: the CUDA one where the pool asks for GPUs."""
        return (self.gpu_image or self.image) if pool.uses_gpus else self.image

    def sets_replicas(self, pool: Pool) -> bool:
        """Whether the operator applies `pool.replicas`: not when an autoscaler or the planner
        owns the pool's size."""
        return pool.autoscaling is None and self.planner is None


def parse_spec(
    raw: Any, default_image: str = "", default_gpu_image: str = ""
) -> InferenceServiceSpec:
    """The typed spec of an `InferenceService`; raises `SpecError` for a spec that cannot run."""
    spec = defaulted_spec(raw)
    engine = spec["engine"]
    mode: Mode = spec["mode"]
    image = spec.get("image") or default_image
    # Pools that ask for GPUs run the CUDA image unless the spec names its own.
    gpu_image = spec.get("image") or default_gpu_image or image
    if not image:
        raise SpecError(
            "MissingImage", "spec.image is empty and the operator has no --default-image"
        )
    if mode == "aggregated":
        pools: tuple[Pool, ...] = (_pool("both", engine, engine["tensorParallelSize"]),)
    else:
        prefill = _pool("prefill", spec["prefill"], engine["tensorParallelSize"])
        decode = _pool("decode", spec["decode"], engine["tensorParallelSize"])
        if prefill.tensor_parallel_size != decode.tensor_parallel_size:
            raise SpecError(
                "TensorParallelMismatch",
                f"decode tensorParallelSize {decode.tensor_parallel_size} differs from prefill's "
                f"{prefill.tensor_parallel_size}: KV blocks move between engines only when both "
                "split the KV heads the same way; set both to the same value",
            )
        pools = (prefill, decode)
    planner = _planner(spec.get("planner"), mode, pools)
    router = spec["router"]
    kv = spec["kvTransfer"]
    extra_args = tuple(engine.get("extraArgs", ()))
    for arg in extra_args:
        _check_no_expansion("spec.engine.extraArgs", arg)
        _check_not_reserved(arg)
    key = spec.get("apiKeySecret")
    return InferenceServiceSpec(
        model=parse_model(spec["model"]),
        image=image,
        gpu_image=gpu_image,
        image_pull_policy=spec["imagePullPolicy"],
        mode=mode,
        engine=EngineArgs(
            max_model_len=engine.get("maxModelLen"),
            block_size=engine["blockSize"],
            max_num_seqs=engine["maxNumSeqs"],
            max_num_batched_tokens=engine.get("maxNumBatchedTokens"),
            dtype=engine["dtype"],
            enable_prefix_caching=engine["enablePrefixCaching"],
            extra_args=extra_args,
        ),
        pools=pools,
        kv_transfer=KVTransfer(kv["transport"], kv["leaseSeconds"], kv["loadFailurePolicy"]),
        router=RouterSpec(
            replicas=router["replicas"],
            policy=router["policy"],
            service_type=router["serviceType"],
            disagg_min_tokens=router["disaggMinTokens"],
            session_affinity=router.get("sessionAffinity"),
            resources=router.get("resources", {}),
            cache_salt_from=router.get("cacheSaltFrom", "client"),
            cache_salt_header=router.get("cacheSaltHeader", "x-tenant-id"),
        ),
        drain=Drain(spec["drain"]["timeoutSeconds"]),
        api_key_secret=(key["name"], key["key"]) if key else None,
        planner=planner,
    )


def _check_no_expansion(field: str, value: str) -> None:
    """Refuses `$(`: the kubelet expands `$(VAR)` in a container's args from its environment, so
    `--served-model-name $(BATON_API_KEY)` would publish the API key in `/v1/models`."""
    if "$(" in value:
        raise SpecError(
            "EnvironmentExpansion",
            f"{field} {value!r} contains '$(', which Kubernetes would expand from the "
            "container's environment (its secrets included); remove it",
        )


# Flags the operator derives and that extraArgs may not override (argparse takes the last one):
# the grace period is computed from the shutdown timeout the operator sets.
RESERVED_ENGINE_ARGS = {"--shutdown-timeout": "spec.drain.timeoutSeconds"}


def _check_not_reserved(arg: str) -> None:
    name = arg.split("=", 1)[0]
    if name in RESERVED_ENGINE_ARGS:
        raise SpecError(
            "ReservedEngineArgument",
            f"spec.engine.extraArgs sets {name}, which the operator derives from "
            f"{RESERVED_ENGINE_ARGS[name]} (the pods' grace period depends on it); set that "
            "field instead",
        )


# A Hugging Face repo id as the engine recognises one (`baton.engine.config.is_repo_id`).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _check_claim_name(where: str, claim: str, reason: str) -> None:
    if len(claim) > CLAIM_NAME_MAX or not re.fullmatch(CLAIM_NAME, claim):
        raise SpecError(
            reason,
            f"{where} {claim!r} is not a PersistentVolumeClaim name (lower-case letters, digits, "
            f"'-' and '.', starting and ending with a letter or digit, at most {CLAIM_NAME_MAX})",
        )


def parse_model(model: dict[str, Any]) -> ModelSource:
    """`hf://org/name[@revision]`, `pvc://claim/path` or `file:///path`."""
    uri: str = model["uri"]
    _check_no_expansion("spec.model.uri", uri)
    scheme, sep, rest = uri.partition("://")
    if ".." in rest.split("/"):
        # The path lands under the model mount (or is the weights' path itself): `..` would
        # reach out of the claim's folder or the download directory.
        raise SpecError(
            "InvalidModelURI", f"spec.model.uri {uri!r}: '..' path segments are refused"
        )
    if not sep or scheme not in MODEL_SCHEMES:
        raise SpecError(
            "UnsupportedModelURI",
            f"spec.model.uri {uri!r}: the scheme must be one of "
            + ", ".join(f"{s}://" for s in MODEL_SCHEMES),
        )
    secret = model.get("hfTokenSecret")
    token = (secret["name"], secret["key"]) if secret else None
    cache = model.get("cache")
    cache_claim: str | None = cache["claimName"] if cache else None
    if cache_claim is not None:
        _check_claim_name("spec.model.cache.claimName", cache_claim, "InvalidModelCache")
        if scheme != "hf":
            raise SpecError(
                "InvalidModelCache",
                f"spec.model.cache is where hf:// models are downloaded; a {scheme}:// model is "
                "read where it is: remove spec.model.cache",
            )
    served: str | None = model.get("servedModelName")
    if served is not None:
        _check_no_expansion("spec.model.servedModelName", served)
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        if not _REPO_ID.fullmatch(repo):
            # The engine takes `--model` for a repo id only in this form (else for a path).
            raise SpecError("InvalidModelURI", f"spec.model.uri {uri!r}: expected hf://org/name")
        return ModelSource(
            uri,
            "hf",
            served or repo,
            hf_repo=repo,
            revision=revision or None,
            hf_token_secret=token,
            cache_claim=cache_claim,
        )
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not claim:
            raise SpecError("InvalidModelURI", f"spec.model.uri {uri!r}: expected pvc://claim/path")
        _check_claim_name(f"spec.model.uri {uri!r}: the claim", claim, "InvalidModelURI")
        name = path.rstrip("/").rsplit("/", 1)[-1] or claim
        return ModelSource(uri, "pvc", served or name, pvc_claim=claim, path=path.strip("/"))
    if not rest.startswith("/") or rest == "/":
        raise SpecError(
            "InvalidModelURI", f"spec.model.uri {uri!r}: expected file:///absolute/path"
        )
    return ModelSource(uri, "file", served or rest.rstrip("/").rsplit("/", 1)[-1], path=rest)


def _pool(role: Role, pool: dict[str, Any], default_tp: int) -> Pool:
    autoscaling = None
    if "autoscaling" in pool:
        autoscaling = _autoscaling("engine" if role == "both" else role, pool["autoscaling"])
    return Pool(
        role=role,
        replicas=pool["replicas"],
        tensor_parallel_size=pool.get("tensorParallelSize", default_tp),
        resources=pool.get("resources", {}),
        node_selector=pool.get("nodeSelector", {}),
        tolerations=pool.get("tolerations", []),
        env=pool.get("env", []),
        autoscaling=autoscaling,
    )


# A Prometheus metric name: a keda engine puts it into a PromQL query as it is.
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
# A Kubernetes quantity: a decimal number, then a binary or decimal SI suffix or an exponent.
_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:([KMGTPE]i|[numkMGTPE])|[eE]([+-]?[0-9]+))?$"
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}  # powers of 2
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def quantity_value(quantity: str) -> Decimal:
    """The number a Kubernetes quantity stands for ("800m" is 0.8, "1Ki" 1024); raises
    `ValueError` for a string that is not a quantity."""
    found = _QUANTITY.match(quantity)
    if found is None:
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity")
    number, suffix, exponent = Decimal(found[1]), found[2], found[3]
    if suffix in _BINARY:
        return number * (1 << _BINARY[suffix])
    if suffix is not None:
        return number.scaleb(_DECIMAL[suffix])
    return number.scaleb(int(exponent)) if exponent is not None else number


def _autoscaling(pool: str, a: dict[str, Any]) -> Autoscaling:
    """The `autoscaling` of the pool field `pool` (prefill, decode or engine), checked."""
    where = f"spec.{pool}.autoscaling"
    if a["minReplicas"] > a["maxReplicas"]:
        raise SpecError(
            "InvalidAutoscaling",
            f"{where}.minReplicas {a['minReplicas']} is above maxReplicas {a['maxReplicas']}",
        )
    target = str(a["target"])
    try:
        positive = quantity_value(target) > 0
    except ValueError:
        positive = False
    if not positive:
        raise SpecError(
            "InvalidAutoscaling",
            f"{where}.target {target!r} is not a positive quantity (such as 4, 0.8 or 800m)",
        )
    engine = a["engine"]
    if engine == "hpa" and a["minReplicas"] == 0:
        raise SpecError(
            "InvalidAutoscaling",
            f"{where}.minReplicas is 0, which needs engine: keda (an HPA never wakes a pool at "
            "zero replicas); set engine: keda, or minReplicas to 1 or more",
        )
    address = a.get("prometheusAddress")
    if engine == "keda":
        if not _METRIC_NAME.match(a["metric"]):
            raise SpecError(
                "InvalidAutoscaling",
                f"{where}.metric {a['metric']!r} is not a Prometheus metric name",
            )
        if address is not None and not re.match(r"^https?://[^\s]+$", address):
            raise SpecError(
                "InvalidAutoscaling",
                f"{where}.prometheusAddress {address!r} is not an http:// or https:// URL",
            )
    return Autoscaling(a["minReplicas"], a["maxReplicas"], a["metric"], target, engine, address)


def _planner(raw: dict[str, Any] | None, mode: Mode, pools: tuple[Pool, ...]) -> PlannerSpec | None:
    """`spec.planner` when present and enabled: it needs prefill and decode pools, and their
    replicas to itself."""
    if raw is None or not raw["enabled"]:
        return None
    if mode != "disaggregated":
        raise SpecError(
            "InvalidPlanner",
            "spec.planner sizes prefill and decode pools, and an aggregated service has neither; "
            "set mode: disaggregated, or remove spec.planner",
        )
    for pool in pools:
        if pool.autoscaling is not None:
            raise SpecError(
                "InvalidPlanner",
                f"spec.{pool.role}.autoscaling is set, but the planner sets the pools' replicas; "
                f"remove spec.{pool.role}.autoscaling, or set spec.planner.enabled: false",
            )
    return PlannerSpec(
        ttft_seconds=float(raw["ttftSeconds"]),
        itl_seconds=float(raw["itlSeconds"]),
        interval_seconds=raw["intervalSeconds"],
        cooldown_seconds=raw["cooldownSeconds"],
        prefill_min=raw["prefill"]["minReplicas"],
        prefill_max=raw["prefill"]["maxReplicas"],
        decode_min=raw["decode"]["minReplicas"],
        decode_max=raw["decode"]["maxReplicas"],
    )
