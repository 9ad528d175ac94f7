"""The KV path canary: for every disaggregated `InferenceService` whose prefill and decode pools
have ready pods, a task of its own runs one real hand-off (`kv_probe.probe`) between a ready
prefill engine and a ready decode engine, soon after the pools become ready and then every
`interval_seconds`, each bounded by `timeout_seconds`. The engines come from the pools' headless
Services' EndpointSlices (the addresses the router uses too).

The canary never writes the status: it keeps its last check and triggers a reconcile pass,
whose status carries `KVPathReady` and `status.kvPath` (`kv_path_ready`, `kv_path`). One writer
of the status means no lost update between the two; a pass only reads the last check, so a
stuck engine never slows a reconcile or another service's canary.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from baton.operator.api import Api
from baton.operator.kv_probe import Engine, ProbeResult, probe
from baton.operator.pods import ENGINE_PORT
from baton.operator.status import condition, now_iso

logger = logging.getLogger(__name__)

Manifest = dict[str, Any]
Key = tuple[str, str]  # namespace, name
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # set on every EndpointSlice of a Service
# Why KVPathReady is not True without a check: nothing to check yet.
POOLS_NOT_READY = "PoolsNotReady"
PENDING = "CanaryPending"
NO_ENGINES = "NoReadyEngines"


@dataclass(frozen=True)
class CanaryConfig:
    """How often and how long (operator flags)."""

    interval_seconds: float = 60.0  # between two checks of one service
    timeout_seconds: float = 10.0  # one whole check: Secret, EndpointSlices, both steps
    retry_seconds: float = 5.0  # after a check that found no ready engine of a pool

    def __post_init__(self) -> None:
        if min(self.interval_seconds, self.timeout_seconds, self.retry_seconds) <= 0:
            raise ValueError("the canary's interval, timeout and retry must be positive")


@dataclass(frozen=True)
class Target:
    """What the canary of one service checks; a new target (a rollout, another transport or
    model) is checked at once."""

    namespace: str
    name: str
    model: str  # the served model name
    transport: str  # what the spec asks for: tcp or nixl
    api_key_secret: tuple[str, str] | None  # (Secret name, key) the engines require
    revision: str


@dataclass(frozen=True)
class Check:
    """One canary run and its outcome."""

    target: Target
    result: ProbeResult
    time: str  # RFC 3339
    prefill: Engine | None = None
    decode: Engine | None = None
    consecutive_failures: int = 0


@dataclass
class Canary:
    """The canary tasks of every service; `trigger` starts a reconcile pass of a service."""

    api: Api
    config: CanaryConfig
    trigger: Callable[[str, str], Coroutine[Any, Any, None]]
    _targets: dict[Key, Target] = field(default_factory=dict)
    _checks: dict[Key, Check] = field(default_factory=dict)
    _tasks: dict[Key, asyncio.Task[None]] = field(default_factory=dict)
    _triggers: set[asyncio.Task[None]] = field(default_factory=set)
    _session: aiohttp.ClientSession | None = None

    def watch(self, key: Key, target: Target | None) -> None:
        """Called by every reconcile pass: `target` while the service's pools are ready, else
        None (which stops its canary). Returns at once."""
        if target is None:
            self._stop(key)
            return
        if self._targets.get(key) == target and key in self._tasks:
            return
        self._stop(key)
        self._targets[key] = target
        task = asyncio.get_running_loop().create_task(self._run(key, target))
        self._tasks[key] = task

    def last(self, key: Key) -> Check | None:
        """The last check of the service's current target, if any."""
        check = self._checks.get(key)
        return check if check is not None and check.target == self._targets.get(key) else None

    def forget(self, key: Key) -> None:
        self._stop(key)
        self._checks.pop(key, None)

    async def close(self) -> None:
        for key in list(self._tasks):
            self._stop(key)
        for task in list(self._triggers):
            task.cancel()
        if self._session is not None:
            await self._session.close()

    def _stop(self, key: Key) -> None:
        self._targets.pop(key, None)
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()

    async def _run(self, key: Key, target: Target) -> None:
        while True:
            check = await self.check(target, self._checks.get(key))
            self._checks[key] = check
            # A task of its own: the pass may stop this canary (and must not be cancelled then).
            spawned = asyncio.get_running_loop().create_task(self.trigger(*key))
            self._triggers.add(spawned)
            spawned.add_done_callback(self._triggers.discard)
            no_engines = check.result.reason == NO_ENGINES
            interval = self.config.interval_seconds
            await asyncio.sleep(
                min(self.config.retry_seconds, interval) if no_engines else interval
            )

    async def check(self, target: Target, previous: Check | None = None) -> Check:
        """One canary run for `target`, within `timeout_seconds`; never raises."""
        engines: list[Engine | None] = [None, None]
        try:
            result = await asyncio.wait_for(
                self._check(target, engines), self.config.timeout_seconds
            )
        except TimeoutError:
            result = ProbeResult(
                False,
                "CanaryHandOffFailed",
                f"the canary hand-off did not finish within {self.config.timeout_seconds:g}s",
            )
        except Exception as e:  # the API or a Secret; the next check tries again
            logger.warning("KV canary of %s/%s failed: %s", target.namespace, target.name, e)
            result = ProbeResult(False, "CanaryHandOffFailed", f"the canary could not run: {e}")
        failures = 0 if result.ok else 1 + (previous.consecutive_failures if previous else 0)
        return Check(target, result, now_iso(), engines[0], engines[1], failures)

    async def _check(self, target: Target, engines: list[Engine | None]) -> ProbeResult:
        prefill = await self._pick(target, "prefill")
        decode = await self._pick(target, "decode")
        engines[:] = [prefill, decode]
        if prefill is None or decode is None:
            missing = " and ".join(
                c for c, e in (("prefill", prefill), ("decode", decode)) if e is None
            )
            message = f"no ready {missing} endpoint in the pools' EndpointSlices yet"
            return ProbeResult(False, NO_ENGINES, message)
        if self._session is None:
            self._session = aiohttp.ClientSession()
        key = await self._api_key(target)
        return await probe(self._session, prefill, decode, target.model, target.transport, key)

    async def _pick(self, target: Target, component: str) -> Engine | None:
        """A random ready engine of the pool (over time every pair gets checked)."""
        selector = f"{SERVICE_NAME_LABEL}={target.name}-{component}"
        slices = await self.api.list(
            "discovery.k8s.io/v1", "EndpointSlice", target.namespace, selector
        )
        found: list[Engine] = []
        for slice_ in slices:
            ports = [p.get("port") for p in slice_.get("ports") or [] if p.get("name") == "http"]
            port = int(ports[0] or ENGINE_PORT) if ports else ENGINE_PORT
            for endpoint in slice_.get("endpoints") or []:
                conditions = endpoint.get("conditions") or {}
                # Kubernetes: an unset `ready` means ready.
                if conditions.get("ready") is False or conditions.get("terminating"):
                    continue
                found += [Engine(address, port) for address in endpoint.get("addresses") or []]
        return random.choice(found) if found else None

    async def _api_key(self, target: Target) -> str | None:
        if target.api_key_secret is None:
            return None
        name, item = target.api_key_secret
        secret = await self.api.get("v1", "Secret", target.namespace, name)
        data = (secret or {}).get("data") or {}
        if item not in data:
            raise ValueError(f"Secret {name!r} (spec.apiKeySecret) has no key {item!r}")
        return base64.b64decode(data[item]).decode().strip()


def kv_path_ready(
    check: Check | None, pools_ready: bool, old: Manifest | None, generation: int
) -> Manifest:
    """The `KVPathReady` condition. It says only whether hand-offs work; `Ready` does not
    depend on it, as a service whose path broke still answers (its decode engines recompute
    under policy `recompute`, or the router's `onNoPrefill` decides), and one failed check
    must not take a serving model out of anyone's rotation."""
    if not pools_ready:
        message = "no canary hand-off until both the prefill and the decode pool have ready pods"
        return condition("KVPathReady", False, POOLS_NOT_READY, message, generation)
    if check is None:
        if old is not None and old.get("reason") not in (POOLS_NOT_READY, None):
            return {**old, "observedGeneration": generation}  # a restarted operator's last word
        message = "the first canary hand-off between the pools has not finished yet"
        return {
            **condition("KVPathReady", False, PENDING, message, generation),
            "status": "Unknown",
        }
    result = check.result
    message = result.message
    if check.consecutive_failures > 1:
        message += f" ({check.consecutive_failures} checks in a row failed)"
    return condition("KVPathReady", result.ok, result.reason, message, generation)


def kv_path(check: Check | None, old: Manifest | None) -> Manifest | None:
    """`status.kvPath`: the last check's transport, bytes, GB/s, latency and engines (the
    previous values while no check has run since the operator started)."""
    if check is None:
        return old
    result = check.result
    out: Manifest = {
        "requestedTransport": check.target.transport,
        "lastCheckTime": check.time,
        "succeeded": result.ok,
        "consecutiveFailures": check.consecutive_failures,
    }
    optional = {
        "transport": result.transport,
        "bytes": result.num_bytes,
        "gbPerSecond": None if result.gb_per_second is None else round(result.gb_per_second, 4),
        "latencyMs": None if result.latency_ms is None else round(result.latency_ms, 3),
        "prefillEngine": str(check.prefill) if check.prefill else None,
        "decodeEngine": str(check.decode) if check.decode else None,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return out
