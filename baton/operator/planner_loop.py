"""The SLO planner's live loop: for each `InferenceService` with `spec.planner`, one asyncio task
that every `intervalSeconds` reads the last interval of the service's metrics from Prometheus
(the series the operator's PodMonitor labels with `namespace`, `inference_service` and `pool`),
turns them into an `Observation`, asks the service's `Planner`, and applies its `Decision`: the
prefill and decode Deployments' `spec.replicas` (server-side applied by a field manager of its
own, as an HPA would own them; the reconciler applies no replicas while the planner is on), a
`PlannerScaled` Event when a count changes, and the decision in `status.planner`.

The controller tells `PlannerLoops` what each service's spec says (`sync`) and when it goes
(`forget`); the planner, and what it learned, lives as long as the service's planner spec does.
When Prometheus cannot be reached or scrapes neither pool, the counts stay as they are and the
status says why: a missing metric must never scale a service down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.dynamic.exceptions import NotFoundError

from baton.operator import crd
from baton.operator.api import Api
from baton.operator.events import event_body
from baton.operator.monitoring import POOL_TARGET_LABEL, SERVICE_TARGET_LABEL
from baton.operator.planner import Decision, Observation, Planner
from baton.operator.spec import PlannerSpec, parse_spec
from baton.operator.status import now_iso
from baton.operator.validation import SpecError

logger = logging.getLogger(__name__)

Manifest = dict[str, Any]
Key = tuple[str, str]  # namespace, name

# The field manager of the replicas the planner sets (the reconciler's is `baton-operator`).
PLANNER_MANAGER = "baton-planner"
POOLS = ("prefill", "decode")
# The router's inference routes: its counters also count /tokenize and /detokenize.
_INFERENCE_ROUTES = 'route=~"/v1/completions|/v1/chat/completions"'
QUERY_TIMEOUT_S = 10.0


class PrometheusError(Exception):
    """Prometheus answered, but not with a result (a bad query, an overloaded server)."""


@dataclass(frozen=True)
class Prometheus:
    """Instant queries through Prometheus' HTTP API (`GET /api/v1/query`)."""

    address: str
    session: aiohttp.ClientSession

    async def value(self, expr: str) -> float | None:
        """The value of `expr`, which must aggregate to at most one series; None when it has
        none, or NaN (a ratio of two zeros, a quantile of an empty histogram)."""
        url = self.address.rstrip("/") + "/api/v1/query"
        timeout = aiohttp.ClientTimeout(total=QUERY_TIMEOUT_S)
        async with self.session.get(url, params={"query": expr}, timeout=timeout) as response:
            try:
                body = await response.json(content_type=None)
            except ValueError as e:
                raise PrometheusError(f"HTTP {response.status}, not JSON") from e
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error") if isinstance(body, dict) else body
            raise PrometheusError(f"HTTP {response.status}: {error} (query {expr})")
        try:
            data = body["data"]
            if data["resultType"] == "scalar":
                found = float(data["result"][1])
            elif data["result"]:
                found = float(data["result"][0]["value"][1])
            else:
                return None
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise PrometheusError(f"an answer of an unknown shape to {expr}") from e
        return None if math.isnan(found) else found


def observation_queries(namespace: str, name: str, interval_s: int) -> dict[str, str]:
    """The PromQL of each figure of one interval of the service `namespace/name`."""
    window = f"[{interval_s}s]"
    service = f'namespace="{namespace}",{SERVICE_TARGET_LABEL}="{name}"'

    def series(metric: str, pool: str, extra: str = "") -> str:
        labels = f'{service},{POOL_TARGET_LABEL}="{pool}"' + (f",{extra}" if extra else "")
        return f"{metric}{{{labels}}}{window}"

    def increase(metric: str, pool: str, extra: str = "") -> str:
        return f"sum(increase({series(metric, pool, extra)}))"

    def mean(histogram: str, pool: str, extra: str = "") -> str:
        total = increase(f"{histogram}_sum", pool, extra)
        return f"{total} / {increase(f'{histogram}_count', pool, extra)}"

    first_byte = "baton:router_time_to_first_byte_seconds"
    buckets = series(f"{first_byte}_bucket", "router", _INFERENCE_ROUTES)
    return {
        "requests": increase("baton:router_requests_total", "router", _INFERENCE_ROUTES),
        "prompt_tokens": increase("vllm:prompt_tokens_total", "prefill"),
        "prefilled": increase("vllm:request_success_total", "prefill"),
        "output_tokens": increase("vllm:generation_tokens_total", "decode"),
        "decoded": increase("vllm:request_success_total", "decode"),
        # Targets scraped, as the mean of `up` over the interval: an engine that was down half
        # of it counts a half.
        "prefill_replicas": f"sum(avg_over_time({series('up', 'prefill')}))",
        "decode_replicas": f"sum(avg_over_time({series('up', 'decode')}))",
        "ttft_p90": f"histogram_quantile(0.9, sum by (le) (increase({buckets})))",
        "ttft_mean": mean(first_byte, "router", _INFERENCE_ROUTES),
        "prefill_ttft_mean": mean("vllm:time_to_first_token_seconds", "prefill"),
        "itl_mean": mean("vllm:inter_token_latency_seconds", "decode"),
    }


async def observe(
    prometheus: Prometheus, namespace: str, name: str, interval_s: int
) -> Observation | None:
    """The last `interval_s` seconds of the service; None when Prometheus scrapes neither of
    its engine pools (no `up` series): no data, which is not the same as no load."""
    queries = observation_queries(namespace, name, interval_s)
    values = await asyncio.gather(*(prometheus.value(q) for q in queries.values()))
    got = dict(zip(queries, values, strict=True))
    if got["prefill_replicas"] is None and got["decode_replicas"] is None:
        return None

    def count(key: str) -> float:
        return max(0.0, got[key] or 0.0)  # a counter with no series counted nothing

    def per(tokens: str, requests: str) -> float:
        return count(tokens) / count(requests) if count(requests) >= 1 else 0.0

    return Observation(
        interval_s=float(interval_s),
        requests=round(count("requests")),  # increase() extrapolates to the window's edges
        prompt_tokens_mean=per("prompt_tokens", "prefilled"),
        output_tokens_mean=per("output_tokens", "decoded"),
        prefill_replicas=count("prefill_replicas"),
        decode_replicas=count("decode_replicas"),
        prefill_tokens_per_s=count("prompt_tokens") / interval_s,
        decode_tokens_per_s=count("output_tokens") / interval_s,
        ttft_p90_s=got["ttft_p90"],
        ttft_mean_s=got["ttft_mean"],
        prefill_ttft_mean_s=got["prefill_ttft_mean"],
        itl_mean_s=got["itl_mean"],
    )


def planner_status(
    counts: tuple[int, int], reason: str, obs: Observation | None = None
) -> Manifest:
    """`status.planner`: the counts the pools were set to, why, and what the planner saw (as a
    merge patch: a figure it did not see is null, which removes the one written before)."""
    rps = None if obs is None else obs.requests / obs.interval_s
    return {
        "prefill": counts[0],
        "decode": counts[1],
        "reason": reason,
        "lastDecisionTime": now_iso(),
        "observed": {
            "requestsPerSecond": rps,
            "ttftP90Seconds": None if obs is None else obs.ttft_p90_s,
            "itlSeconds": None if obs is None else obs.itl_mean_s,
        },
    }


@dataclass
class _Service:
    """One service's loop: its planner spec as the controller last saw it, and the planner,
    rebuilt (forgetting what it learned) when that spec changes."""

    spec: PlannerSpec
    task: asyncio.Task[None] | None = None
    planner: Planner | None = None
    failing: bool = False  # within a streak of failed intervals (logged once)


class PlannerLoops:
    """The planner loops of every service with a planner, through `api` and the Prometheus at
    `prometheus_address`."""

    def __init__(self, api: Api, prometheus_address: str, default_image: str = "") -> None:
        self.api = api
        self.prometheus_address = prometheus_address
        self.default_image = default_image
        self._services: dict[Key, _Service] = {}
        self._session: aiohttp.ClientSession | None = None

    def sync(self, isvc: Manifest) -> None:
        """Starts, updates or stops the loop of `isvc` after what its spec says now; a spec
        that does not parse has no planner (the reconciler reports why). Must not block."""
        meta = isvc["metadata"]
        key = (meta["namespace"], meta["name"])
        try:
            spec = parse_spec(isvc.get("spec"), self.default_image).planner
        except SpecError:
            spec = None
        if spec is None or meta.get("deletionTimestamp"):
            self.forget(*key)
            return
        service = self._services.get(key)
        if service is None:
            service = self._services[key] = _Service(spec)
        service.spec = spec
        if service.task is None or service.task.done():
            service.task = asyncio.get_running_loop().create_task(self._run(key, service))

    def forget(self, namespace: str, name: str) -> None:
        """Stops the loop of a service that went or turned its planner off; the replicas stay
        as the planner left them."""
        service = self._services.pop((namespace, name), None)
        if service is not None and service.task is not None:
            service.task.cancel()

    def running(self) -> set[Key]:
        """The services whose loop runs."""
        return {k for k, s in self._services.items() if s.task and not s.task.done()}

    async def close(self) -> None:
        tasks = [s.task for s in self._services.values() if s.task is not None]
        self._services.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()

    async def _run(self, key: Key, service: _Service) -> None:
        """Every interval, one step; a failed one is logged (once a streak) and the loop goes
        on. Ends when the service is gone."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at = max(next_at + service.spec.interval_seconds, loop.time())
            await asyncio.sleep(next_at - loop.time())
            try:
                if not await self._step(key, service):
                    return
            except (ApiException, aiohttp.ClientError, TimeoutError) as e:
                self._failed(key, service, f"the API server failed: {e}")

    async def _step(self, key: Key, service: _Service) -> bool:
        """One interval of one service; False when the service is gone."""
        isvc = await self.api.get(crd.API_VERSION, crd.KIND, *key)
        if isvc is None or isvc["metadata"].get("deletionTimestamp"):
            self._services.pop(key, None)
            return False
        deployments = [
            await self.api.get("apps/v1", "Deployment", key[0], f"{key[1]}-{pool}")
            for pool in POOLS
        ]
        if any(d is None for d in deployments):
            return True  # the reconciler has not made them yet
        current = tuple(int((d or {}).get("spec", {}).get("replicas", 1)) for d in deployments)
        counts = (current[0], current[1])
        if service.planner is None or service.planner.spec != service.spec:
            service.planner = Planner(service.spec)
        try:
            obs = await observe(self._prometheus(), *key, interval_s=service.spec.interval_seconds)
        except (aiohttp.ClientError, TimeoutError, PrometheusError) as e:
            reason = f"Prometheus at {self.prometheus_address} failed ({e}); holding the counts"
            self._failed(key, service, reason)
            await self._write_status(isvc, planner_status(counts, reason))
            return True
        if obs is None:
            reason = (
                f"Prometheus at {self.prometheus_address} has no metrics of the prefill or "
                "decode pods (is the PodMonitor selected?); holding the counts"
            )
            self._failed(key, service, reason)
            await self._write_status(isvc, planner_status(counts, reason))
            return True
        if service.failing:
            logger.info("planner %s/%s: metrics are back", *key)
            service.failing = False
        service.planner.observe(obs)
        decision = service.planner.decide(time.monotonic(), *counts)
        await self._apply(isvc, counts, decision)
        new = (decision.prefill, decision.decode)
        await self._write_status(isvc, planner_status(new, decision.reason, obs))
        return True

    def _prometheus(self) -> Prometheus:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return Prometheus(self.prometheus_address, self._session)

    def _failed(self, key: Key, service: _Service, reason: str) -> None:
        if not service.failing:
            logger.warning("planner %s/%s: %s", *key, reason)
        service.failing = True

    async def _apply(self, isvc: Manifest, counts: tuple[int, int], decision: Decision) -> None:
        """Sets the replicas of the pools whose count changes, and posts one Event if any did."""
        meta = isvc["metadata"]
        changed = False
        for pool, old, new in zip(POOLS, counts, (decision.prefill, decision.decode), strict=True):
            if new == old:
                continue
            replicas = {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": f"{meta['name']}-{pool}", "namespace": meta["namespace"]},
                "spec": {"replicas": new},
            }
            logger.info(
                "planner: %s/%s %s %d -> %d", meta["namespace"], meta["name"], pool, old, new
            )
            await self.api.apply(replicas, PLANNER_MANAGER, force=True)
            changed = True
        if changed:
            try:
                await self.api.create(event_body(isvc, "Normal", "PlannerScaled", decision.reason))
            except ApiException as e:  # an Event is a courtesy
                logger.warning("could not post an Event for %s: %s", meta["name"], e)

    async def _write_status(self, isvc: Manifest, planner: Manifest) -> None:
        with contextlib.suppress(NotFoundError):  # deleted meanwhile; the next step ends the loop
            await self.api.patch_status(isvc, {"status": {"planner": planner}})
