"""Pure builders of the engine and router pod templates: command lines, probes, the drain
arithmetic (shutdown timeouts and grace periods), the model's volume, GPU requests, the API key,
the hand-off secret's mount, and the Pod Security "restricted" settings (non-root, no privilege
escalation, no capabilities, RuntimeDefault seccomp, a read-only root with emptyDir scratch
where the code writes). No I/O; `resources.py` wraps these templates into Deployments.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from baton.operator.spec import GPU, InferenceServiceSpec, ModelSource, Pool

ENGINE_PORT = 8000
KV_PORT = 14579
KV_EVENTS_PORT = 5557  # vLLM's default KV events port; replay on the next one
ROUTER_PORT = 8000
MODEL_MOUNT = "/models"
# An hf:// model's Hugging Face cache (`--download-dir`): on `spec.model.cache`'s claim, shared
# by every engine pod of the service and kept across restarts, or on the pod's own emptyDir.
HUB_DIR = f"{MODEL_MOUNT}/hub"
# How long the startup probe waits for `/health` before the kubelet restarts the container:
# loading weights, and for hf:// downloading them first (the engine resolves the repo id before
# it listens; after a restart it keeps the files it finished and fetches the rest).
PROBE_PERIOD_SECONDS = 10
LOAD_SECONDS = 15 * 60
DOWNLOAD_SECONDS = 60 * 60
# The drain arithmetic. Kubernetes counts `terminationGracePeriodSeconds` from the start of the
# preStop hook and sends SIGTERM when the hook ends, SIGKILL when the period is over:
#   grace = preStop + shutdown timeout + exit.
# - preStop (PRESTOP_SLEEP_SECONDS): the pod keeps serving while its endpoint's removal reaches
#   every router; requests admitted then are in flight at SIGTERM.
# - shutdown timeout (`--shutdown-timeout`, the engine's whole drain, run_server): admission
#   closes, in-flight requests finish, then a prefill engine waits until its leased KV blocks
#   are claimed or expire, at most the lease time plus one poll. The last lease starts when the
#   last in-flight request ends, at most `spec.drain.timeoutSeconds` (D) after SIGTERM, and
#   expires at most `kvTransfer.leaseSeconds` (L) later, so a prefill engine gets D + L + 1 s
#   and outlives every lease it handed out; decode and aggregated engines hold none: D.
# - exit (ENGINE_EXIT_SECONDS): uvicorn's 2 s close and up to 10 s for the EngineCore to stop,
#   with a margin, so that SIGKILL never lands in the middle of a drain that kept its time.
# The router drains its open streams in D (`--router-shutdown-timeout`, uvicorn's graceful
# shutdown) and exits at once after.
PRESTOP_SLEEP_SECONDS = 10
LEASE_POLL_SECONDS = 1  # _wait_leases: the core frees an expired lease at its next poll
ENGINE_EXIT_SECONDS = 15
ROUTER_EXIT_SECONDS = 5
# The image's user (Dockerfile: `useradd --uid 10001`); runAsNonRoot needs a numeric one.
RUN_AS_USER = 10001
# The environment variables the engine and router read their API key from (as vLLM's
# VLLM_API_KEY), and the one the router sends to the engines.
API_KEY_ENV = "BATON_API_KEY"
UPSTREAM_API_KEY_ENV = "BATON_UPSTREAM_API_KEY"
# Writable scratch on a read-only root: /tmp (tempfile: the engine's IPC sockets, worker
# folders, torch inductor) and one cache folder that every cache is pointed into (the built-in
# model and compiled CPU kernels under $BATON_CACHE_DIR, Triton's kernels, Hugging Face).
TMP_MOUNT = "/tmp"
CACHE_MOUNT = "/cache"
CACHE_ENV: tuple[tuple[str, str], ...] = (
    ("BATON_CACHE_DIR", f"{CACHE_MOUNT}/baton"),
    ("TRITON_CACHE_DIR", f"{CACHE_MOUNT}/triton"),
    ("HF_HOME", f"{CACHE_MOUNT}/huggingface"),
    ("XDG_CACHE_HOME", CACHE_MOUNT),
)

# The per-service hand-off secret (`resources.kv_secret`): a directory mount, not a subPath,
# so that the kubelet's refresh of an edited Secret reaches the file the engine re-reads.
KV_SECRET_VOLUME = "kv-secret"
KV_SECRET_MOUNT = "/etc/baton/kv-secret"
KV_SECRET_KEY = "keys"
KV_SECRET_FILE = f"{KV_SECRET_MOUNT}/{KV_SECRET_KEY}"
# Owner root, group fsGroup (the pods' user), read-only, nothing for others.
KV_SECRET_MODE = 0o440

Manifest = dict[str, Any]


def model_args(model: ModelSource) -> list[str]:
    """`--model` inside the engine container: an hf:// repo id, which the engine resolves
    through the Hugging Face cache under `HUB_DIR` (downloading it when missing), or a folder."""
    if model.scheme == "hf":
        assert model.hf_repo is not None  # set by parse_model for hf://
        revision = ["--revision", model.revision] if model.revision else []
        return ["--model", model.hf_repo, *revision, "--download-dir", HUB_DIR]
    if model.scheme == "pvc":
        return ["--model", f"{MODEL_MOUNT}/{model.path}".rstrip("/")]
    return ["--model", model.path]


def engine_shutdown_timeout(spec: InferenceServiceSpec, pool: Pool) -> int:
    """The pool's `--shutdown-timeout`: the drain time, and for prefill the lease after it."""
    if pool.role == "prefill":
        return spec.drain.timeout_seconds + spec.kv_transfer.lease_seconds + LEASE_POLL_SECONDS
    return spec.drain.timeout_seconds


def engine_grace_seconds(spec: InferenceServiceSpec, pool: Pool) -> int:
    """The pool's `terminationGracePeriodSeconds`: preStop, the whole drain, the exit."""
    return PRESTOP_SLEEP_SECONDS + engine_shutdown_timeout(spec, pool) + ENGINE_EXIT_SECONDS


def router_grace_seconds(spec: InferenceServiceSpec) -> int:
    """The router's `terminationGracePeriodSeconds`: preStop, its drain, the exit."""
    return PRESTOP_SLEEP_SECONDS + spec.drain.timeout_seconds + ROUTER_EXIT_SECONDS


def engine_args(spec: InferenceServiceSpec, pool: Pool) -> list[str]:
    """`baton engine ...` for one pool; `$(POD_IP)` is expanded by the kubelet."""
    engine, kv = spec.engine, spec.kv_transfer
    args = [
        "engine",
        *model_args(spec.model),
        # Always given: the engine would name an hf:// model by its repo id, a folder by its path.
        "--served-model-name", spec.model.served_model_name,
        "--host", "0.0.0.0",
        "--port", str(ENGINE_PORT),
        "--role", pool.role,
        "--block-size", str(engine.block_size),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--dtype", engine.dtype,
        "--tensor-parallel-size", str(pool.tensor_parallel_size),
        "--shutdown-timeout", str(engine_shutdown_timeout(spec, pool)),
    ]  # fmt: skip
    if pool.moves_kv:
        args += [
            "--kv-transport", kv.transport,
            "--kv-port", str(KV_PORT),
            "--kv-host", "$(POD_IP)",  # the KV ports listen on the pod IP only, not everywhere
            "--kv-lease-seconds", str(kv.lease_seconds),
            "--kv-load-failure-policy", kv.load_failure_policy,
            "--kv-secret-file", KV_SECRET_FILE,
        ]  # fmt: skip
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    args.append(
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching"
    )
    if engine.enable_prefix_caching:
        args += ["--kv-events-config", kv_events_config(spec)]
    return args + list(engine.extra_args)


def kv_events_config(spec: InferenceServiceSpec) -> str:
    """The engine's `--kv-events-config`: its block pool's events published on the pod IP for
    the router (which reads the ports from /health), under llm-d's topic convention
    (`kv@<pod>@<model>`) so that llm-d's KV indexer can read them too."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://$(POD_IP):{KV_EVENTS_PORT}",
        "replay_endpoint": f"tcp://$(POD_IP):{KV_EVENTS_PORT + 1}",
        "topic": f"kv@$(POD_IP)@{spec.model.served_model_name}",
    }
    return json.dumps(config, separators=(",", ":"))


def engine_resources(pool: Pool) -> dict[str, Any]:
    """The pool's resources, with `tensorParallelSize` GPUs when they ask for GPUs at all."""
    resources = copy.deepcopy(pool.resources)
    if pool.uses_gpus:
        # Extended resources must have equal requests and limits; the TP degree decides both.
        resources.setdefault("limits", {})[GPU] = pool.tensor_parallel_size
        if GPU in resources.get("requests", {}):
            resources["requests"][GPU] = pool.tensor_parallel_size
    return resources


def pod_security_context() -> Manifest:
    """The pod half of Pod Security "restricted"."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        # Mounted Secrets belong to root; this group lets the user read them at mode 0440, and
        # the user write to an hf:// model's cache claim. A pvc:// model is mounted read-only,
        # so the kubelet changes nothing on it; on a cache claim that keeps its ownership it
        # changes nothing either (no recursive walk of the weights at every start).
        "fsGroup": RUN_AS_USER,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> Manifest:
    """The container half of Pod Security "restricted", and a read-only root."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _scratch() -> tuple[list[Manifest], list[Manifest], list[Manifest]]:
    """Volumes, mounts and cache env for a read-only root."""
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    mounts = [
        {"name": "tmp", "mountPath": TMP_MOUNT},
        {"name": "cache", "mountPath": CACHE_MOUNT},
    ]
    env = [{"name": name, "value": value} for name, value in CACHE_ENV]
    return volumes, mounts, env


def _secret_env(name: str, secret: tuple[str, str]) -> Manifest:
    ref = {"name": secret[0], "key": secret[1]}
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def _probes(port: str, startup_seconds: int = LOAD_SECONDS) -> dict[str, Any]:
    def probe(period: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": period,
            "failureThreshold": failures,
            "timeoutSeconds": 5,
        }

    return {
        # Loading weights may take minutes; liveness starts only once this has passed.
        "startupProbe": probe(PROBE_PERIOD_SECONDS, startup_seconds // PROBE_PERIOD_SECONDS),
        "readinessProbe": probe(5, 2),
        "livenessProbe": probe(10, 6),
    }


def _model_volume(spec: InferenceServiceSpec) -> tuple[list[Manifest], list[Manifest]]:
    """The volume that holds the weights and the engine container's mount of it: a pvc://
    claim read-only; for hf:// the Hugging Face cache the engine downloads into, read-write, on
    `spec.model.cache`'s claim or else an emptyDir (a restarted container reuses it, a new pod
    downloads again); nothing for file://."""
    model = spec.model
    if model.scheme == "file":
        return [], []
    if model.scheme == "pvc":
        claim = {"claimName": model.pvc_claim, "readOnly": True}
        mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        return [{"name": "model", "persistentVolumeClaim": claim}], [mount]
    source: Manifest = (
        {"persistentVolumeClaim": {"claimName": model.cache_claim}}
        if model.cache_claim
        else {"emptyDir": {}}
    )
    return [{"name": "model", **source}], [{"name": "model", "mountPath": MODEL_MOUNT}]


def engine_pod(
    spec: InferenceServiceSpec,
    pool: Pool,
    labels: dict[str, str],
    annotations: dict[str, str],
    kv_secret: str,
) -> Manifest:
    """The pod template of one engine pool; a pool that moves KV mounts the Secret `kv_secret`."""
    volumes, mounts = _model_volume(spec)
    scratch_volumes, scratch_mounts, cache_env = _scratch()
    volumes += scratch_volumes
    mounts += scratch_mounts
    if pool.tensor_parallel_size > 1:
        # Tensor-parallel workers exchange tensors through shared memory; the default 64 MiB
        # /dev/shm is too small.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if pool.moves_kv:
        source = {"secretName": kv_secret, "defaultMode": KV_SECRET_MODE}
        volumes.append({"name": KV_SECRET_VOLUME, "secret": source})
        mounts.append({"name": KV_SECRET_VOLUME, "mountPath": KV_SECRET_MOUNT, "readOnly": True})
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    key = spec.api_key_secret
    key_env = [_secret_env(API_KEY_ENV, key)] if key else []
    token = spec.model.hf_token_secret if spec.model.scheme == "hf" else None
    token_env = [_secret_env("HF_TOKEN", token)] if token else []
    container: Manifest = {
        "name": "engine",
        "image": spec.image_for(pool),
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["baton"],
        "args": engine_args(spec, pool),
        "ports": [
            {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
            # Each tensor-parallel rank serves its KV shard on its own port: rank r on +r.
            *(
                {"name": f"kv-{r}" if r else "kv", "containerPort": KV_PORT + r, "protocol": "TCP"}
                for r in range(pool.tensor_parallel_size if pool.moves_kv else 0)
            ),
            # The KV cache events (vLLM's format) and their replay socket.
            *(
                {"name": name, "containerPort": KV_EVENTS_PORT + i, "protocol": "TCP"}
                for i, name in enumerate(("kv-events", "kv-replay"))
                if spec.engine.enable_prefix_caching
            ),
        ],
        "env": [pod_ip, *cache_env, *key_env, *token_env, *copy.deepcopy(pool.env)],
        "resources": engine_resources(pool),
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        **_probes("http", DOWNLOAD_SECONDS if spec.model.scheme == "hf" else LOAD_SECONDS),
    }
    pod_spec: Manifest = {
        # Engines never call the API server; a token in the pod is only something to steal.
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
        # preStop, then SIGTERM drains in-flight requests and lets KV leases run out.
        "terminationGracePeriodSeconds": engine_grace_seconds(spec, pool),
        "nodeSelector": dict(pool.node_selector),
        "tolerations": copy.deepcopy(pool.tolerations),
    }
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}


def router_pod(
    spec: InferenceServiceSpec,
    namespace: str,
    selector: str,
    service_account: str,
    labels: dict[str, str],
    annotations: dict[str, str],
) -> Manifest:
    """The pod template of the router that discovers this service's engines."""
    router = spec.router
    args = [
        "router",
        "--host", "0.0.0.0",
        "--port", str(ROUTER_PORT),
        "--discovery", "kubernetes",
        "--namespace", namespace,
        "--selector", selector,
        # Served while its pools are at zero: its requests wait for an engine, not a 404.
        "--served-model", spec.model.served_model_name,
        "--policy", router.policy,
        "--disagg-min-tokens", str(router.disagg_min_tokens),
        "--router-shutdown-timeout", str(spec.drain.timeout_seconds),
        "--cache-salt-from", router.cache_salt_from,
        "--cache-salt-header", router.cache_salt_header,
    ]  # fmt: skip
    if router.session_affinity is not None:
        args.append("--session-affinity" if router.session_affinity else "--no-session-affinity")
    volumes, mounts, env = _scratch()
    if spec.api_key_secret:
        # One key both ways: clients present it to the router, the router to the engines.
        env += [
            _secret_env(API_KEY_ENV, spec.api_key_secret),
            _secret_env(UPSTREAM_API_KEY_ENV, spec.api_key_secret),
        ]
    container: Manifest = {
        "name": "router",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["baton"],
        "args": args,
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": copy.deepcopy(router.resources),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        **_probes("http"),
    }
    pod_spec: Manifest = {
        "serviceAccountName": service_account,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": router_grace_seconds(spec),
    }
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}
