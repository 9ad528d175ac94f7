"""Engine health: active checks on a timer, passive ejection after failed requests, recovery.

Active: every `health_interval` each engine gets `GET /health` (its models come from
`GET /v1/models` until known) and `GET /metrics` (its load, for least-load and prefix-aware
routing). A failed check takes the engine out; a passing one brings it back.
Passive: `eject_after_failures` failed requests in a row eject an engine for at least
`eject_seconds`, and it returns only once an active check passes after that.
An engine that fails a check, or disappears, loses its entry in the prefix index: whatever
it cached is presumed gone.
Checks carry the engines' key (`UpstreamAuth`): /health and /metrics are open, /v1/models is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from baton.router.config import RouterConfig
from baton.router.engines import EngineSet, EngineState
from baton.router.metrics import RouterMetrics
from baton.router.upstream_auth import UpstreamAuth

logger = logging.getLogger(__name__)

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = "vllm:kv_cache_usage_perc"
# Bounds on what /health may make the router keep and show: a fingerprint is 32 hex digits
# today; its parts are a dozen short values.
MAX_FINGERPRINT = 128
MAX_PARTS, MAX_PART = 32, 128


def parse_load(text: str) -> tuple[float, float]:
    """(running + waiting, KV cache usage) from an engine's Prometheus exposition."""
    load, usage = 0.0, 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in (_RUNNING, _WAITING, _KV_USAGE):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if name == _KV_USAGE:
            usage = max(usage, value)
        else:
            load += value
    return load, usage


class HealthMonitor:
    """Runs the active checks of every engine and applies the passive ejection rule."""

    def __init__(
        self,
        engines: EngineSet,
        session: Callable[[], aiohttp.ClientSession],
        config: RouterConfig,
        metrics: RouterMetrics,
        on_cache_lost: Callable[[EngineState], None],
        on_health: Callable[[EngineState, dict[str, Any]], None] | None = None,
    ) -> None:
        self.engines = engines
        self.session = session
        self.config = config
        self.metrics = metrics
        self.on_cache_lost = on_cache_lost
        self.on_health = on_health  # every /health answer of 200, as a JSON object
        self.auth = UpstreamAuth(config)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # -- the active checks --

    def watch(self, state: EngineState) -> None:
        """Starts checking `state` now and every `health_interval` after."""
        self.unwatch(state)
        self._tasks[state.url] = asyncio.create_task(self._loop(state), name=f"health {state.url}")

    def unwatch(self, state: EngineState) -> None:
        task = self._tasks.pop(state.url, None)
        if task is not None:
            task.cancel()
        self.on_cache_lost(state)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self, state: EngineState) -> None:
        while True:
            try:
                await self.check(state)
            except Exception:  # a bug here must not end the checks
                logger.exception("health check of %s failed", state.url)
            await asyncio.sleep(self.config.health_interval)

    async def check(self, state: EngineState) -> None:
        """One active check: /health, then /v1/models while unknown, then /metrics."""
        ok, why = False, ""
        try:
            status, body = await self._get(state, "/health")
            ok = status == 200
            why = f"/health answered {status}"
            if ok:
                read_compatibility(state, body)
            if ok and not state.cards:
                await self._fetch_models(state)
                ok = bool(state.models)
                why = "/v1/models lists no model"
            if ok and self.on_health is not None:
                self.on_health(state, json_object(body))
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
        if ok:
            await self._scrape(state)
        self._set_healthy(state, ok, why)
        state.checked = True

    async def _get(self, state: EngineState, path: str) -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        async with self.session().get(
            state.url + path, timeout=timeout, headers=self.auth.headers, ssl=self.auth.ssl
        ) as response:
            return response.status, await response.read()

    async def _fetch_models(self, state: EngineState) -> None:
        status, body = await self._get(state, "/v1/models")
        if status != 200:
            raise ValueError(f"/v1/models answered {status}")
        cards = {
            str(card["id"]): card
            for card in json.loads(body).get("data", [])
            if isinstance(card, dict) and "id" in card
        }
        state.cards = cards
        if state.endpoint.model is None:
            state.models = tuple(sorted(cards))

    async def _scrape(self, state: EngineState) -> None:
        try:
            status, body = await self._get(state, "/metrics")
        except (aiohttp.ClientError, TimeoutError):
            return
        if status == 200:
            state.scraped_load, _ = parse_load(body.decode(errors="replace"))
            state.in_flight_at_scrape = state.in_flight

    def _set_healthy(self, state: EngineState, ok: bool, why: str) -> None:
        if ok and not state.healthy:
            logger.info("engine %s (%s) is healthy", state.url, state.role)
            state.consecutive_failures = 0
        elif not ok and state.healthy:
            logger.warning("engine %s (%s) failed its health check: %s", state.url, state.role, why)
            self.metrics.ejection(state.url)
            self.on_cache_lost(state)
        elif not ok and not state.checked:
            logger.warning("engine %s (%s) is not ready: %s", state.url, state.role, why)
        state.healthy = ok

    # -- passive health --

    def on_success(self, state: EngineState) -> None:
        state.consecutive_failures = 0

    def on_failure(self, state: EngineState, kind: str) -> None:
        """A request to `state` failed before its answer began (or its stream broke)."""
        self.metrics.upstream_error(state.url, kind)
        state.consecutive_failures += 1
        if state.consecutive_failures < self.config.eject_after_failures:
            return
        now = time.monotonic()
        if state.ejected_until is not None and now < state.ejected_until:
            return
        logger.warning(
            "ejecting engine %s (%s) for %.1f s after %d failed requests (last: %s)",
            state.url,
            state.role,
            self.config.eject_seconds,
            state.consecutive_failures,
            kind,
        )
        state.ejected_until = now + self.config.eject_seconds
        state.healthy = False  # back only after an active check passes
        self.metrics.ejection(state.url)


def read_compatibility(state: EngineState, health: bytes) -> None:
    """Sets what `state.can_pair_with` compares from the engine's /health answer: its
    tensor_parallel_size, its fingerprint and the fingerprint's parts; each None (or empty)
    when the answer does not say, or says something malformed."""
    body = json_object(health)
    size = body.get("tensor_parallel_size")
    ok_size = isinstance(size, int) and not isinstance(size, bool) and size > 0
    state.tensor_parallel_size = size if ok_size else None
    fingerprint = body.get("fingerprint")
    ok_fingerprint = isinstance(fingerprint, str) and 0 < len(fingerprint) <= MAX_FINGERPRINT
    previous, state.fingerprint = state.fingerprint, fingerprint if ok_fingerprint else None
    if state.fingerprint != previous and previous is not None:
        logger.info(
            "engine %s (%s) changed fingerprint %s -> %s",
            state.url, state.role, previous, state.fingerprint,
        )  # fmt: skip
    parts = body.get("compatibility")
    state.compatibility = (
        {
            str(k)[:MAX_PART]: v if not isinstance(v, str) else v[:MAX_PART]
            for k, v in list(parts.items())[:MAX_PARTS]
            if isinstance(v, str | int | float | bool)
        }
        if isinstance(parts, dict)
        else {}
    )


def json_object(data: bytes) -> dict[str, Any]:
    """`data` as a JSON object; empty when it is not one."""
    try:
        body = json.loads(data)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
