"""One canary KV hand-off between a ready prefill engine and a ready decode engine, as a client
would do it: both engines' `/health` (same fingerprint? which transport is really in use?), a
tiny prompt of token ids to the prefill engine with `do_remote_decode`, its signed
`kv_transfer_params` unchanged to the decode engine with policy `fail`, and the decode engine's
`/metrics` before and after for the bytes and seconds of the pull. Plain HTTP, no Kubernetes:
`canary.py` finds the engines and writes the status.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

# The decode engine's pull counters (`baton/engine/api/metrics.py`).
BYTES = "baton:kv_transfer_bytes_total"
SECONDS_SUM = "baton:kv_transfer_seconds_sum"
SECONDS_COUNT = "baton:kv_transfer_seconds_count"
FAILURES = "baton:kv_transfer_failures_total"
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Engine:
    """One engine's HTTP address, as an EndpointSlice names it."""

    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def __str__(self) -> str:
        return self.url.removeprefix("http://")


@dataclass(frozen=True)
class ProbeResult:
    """What one canary hand-off found. `reason` is the `KVPathReady` reason."""

    ok: bool
    reason: str  # CanaryHandOffSucceeded, CanaryHandOffFailed, IncompatibleEngines, ...
    message: str
    transport: str | None = None  # what the decode engine's /health says it uses
    num_bytes: int | None = None  # pulled by the canary, from the metrics delta
    gb_per_second: float | None = None
    latency_ms: float | None = None


class ProbeError(Exception):
    """A step of the canary failed; the message says which and what the engine answered."""


def parse_samples(text: str) -> dict[str, float]:
    """The sum over labels of every sample in a Prometheus text page, by sample name; failure
    counters are also kept per `reason` label (`name{reason}`)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.partition("{")
        try:
            number = float(value)
        except ValueError:
            continue
        totals[name] = totals.get(name, 0.0) + number
        if name == FAILURES and 'reason="' in labels:
            reason = labels.split('reason="', 1)[1].split('"', 1)[0]
            totals[f"{name}{{{reason}}}"] = totals.get(f"{name}{{{reason}}}", 0.0) + number
    return totals


async def _get(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> str:
    async with session.get(url, headers=headers) as response:
        text = await response.text()
        if response.status != 200:
            raise ProbeError(f"GET {url} answered {response.status}: {text[:200]}")
        return text


async def _health(
    session: aiohttp.ClientSession, engine: Engine, headers: dict[str, str]
) -> dict[str, Any]:
    async with session.get(f"{engine.url}/health", headers=headers) as response:
        if response.status != 200:
            raise ProbeError(f"{engine} /health answered {response.status}")
        body = await response.read()
    if not body.strip():
        return {}  # an engine of an older Baton says only 200
    try:
        found = await response.json(content_type=None)
    except ValueError as e:
        raise ProbeError(f"{engine} /health is not JSON: {e}") from None
    return found if isinstance(found, dict) else {}


async def _complete(
    session: aiohttp.ClientSession, engine: Engine, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    async with session.post(f"{engine.url}/v1/completions", json=body, headers=headers) as r:
        text = await r.text()
        if r.status != 200:
            raise ProbeError(f"{engine} answered {r.status}: {text[:300]}")
    try:
        answer = await r.json(content_type=None)
    except ValueError as e:
        raise ProbeError(f"{engine} answered no JSON: {e}") from None
    return answer if isinstance(answer, dict) else {}


def canary_prompt(block_size: int) -> list[int]:
    """Two full blocks and one token of fresh random ids: never a prefix-cache hit, so the
    decode engine must pull; small ids, which every vocabulary has."""
    return [random.randrange(1, 256) for _ in range(2 * block_size + 1)]


async def probe(
    session: aiohttp.ClientSession,
    prefill: Engine,
    decode: Engine,
    model: str,
    wanted_transport: str,
    api_key: str | None,
) -> ProbeResult:
    """One hand-off from `prefill` to `decode`; never raises `ProbeError` (the caller bounds
    its time)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return await _probe(session, prefill, decode, model, wanted_transport, headers)
    except ProbeError as e:
        return ProbeResult(False, "CanaryHandOffFailed", str(e))
    except aiohttp.ClientError as e:
        return ProbeResult(False, "CanaryHandOffFailed", f"HTTP to an engine failed: {e!r}")


async def _probe(
    session: aiohttp.ClientSession,
    prefill: Engine,
    decode: Engine,
    model: str,
    wanted_transport: str,
    headers: dict[str, str],
) -> ProbeResult:
    p_health = await _health(session, prefill, headers)
    d_health = await _health(session, decode, headers)
    p_fp, d_fp = p_health.get("fingerprint"), d_health.get("fingerprint")
    if p_fp != d_fp:
        return ProbeResult(
            False,
            "IncompatibleEngines",
            f"prefill {prefill} has fingerprint {p_fp}, decode {decode} has {d_fp}: they run "
            "different weights or settings and cannot hand KV over",
        )
    transport = d_health.get("kv_transport") or p_health.get("kv_transport")
    compatibility = d_health.get("compatibility") or {}
    block_size = int(compatibility.get("block_size") or DEFAULT_BLOCK_SIZE)
    prompt = canary_prompt(block_size)

    before = parse_samples(await _get(session, f"{decode.url}/metrics", headers))
    request = {"model": model, "prompt": prompt, "max_tokens": 1}
    step1 = {**request, "kv_transfer_params": {"do_remote_decode": True}}
    params = (await _complete(session, prefill, step1, headers)).get("kv_transfer_params")
    if not isinstance(params, dict):
        raise ProbeError(f"prefill {prefill} answered without kv_transfer_params")
    # Policy fail: a pull that fails is a 503 here, not a silent local recompute.
    remote = {**params, "do_remote_prefill": True, "kv_load_failure_policy": "fail"}
    step2 = {**request, "kv_transfer_params": remote}
    started = time.perf_counter()
    await _complete(session, decode, step2, headers)
    step2_seconds = time.perf_counter() - started
    after = parse_samples(await _get(session, f"{decode.url}/metrics", headers))

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    failed = {k: delta(k) for k in after if k.startswith(FAILURES + "{") and delta(k) > 0}
    if failed:
        reasons = ", ".join(k.split("{", 1)[1].rstrip("}") for k in failed)
        raise ProbeError(f"decode {decode} answered, but its pull failed meanwhile ({reasons})")
    # A busy engine's concurrent pulls land in the same counters, so under load these numbers
    # blur into the average of every pull in the interval; on an idle pair they are the canary's.
    pulls, seconds, num_bytes = delta(SECONDS_COUNT), delta(SECONDS_SUM), delta(BYTES)
    latency = seconds / pulls if pulls > 0 else step2_seconds
    rate = num_bytes / seconds / 1e9 if pulls > 0 and seconds > 0 else None
    measured = (
        f"{int(num_bytes)} bytes in {latency * 1e3:.1f} ms"
        if pulls > 0
        else f"no pull in the decode engine's metrics; step 2 took {step2_seconds * 1e3:.1f} ms"
    )

    def result(ok: bool, reason: str, message: str) -> ProbeResult:
        return ProbeResult(
            ok,
            reason,
            message,
            transport=transport,
            num_bytes=int(num_bytes) if pulls > 0 else None,
            gb_per_second=rate,
            latency_ms=latency * 1e3,
        )

    if wanted_transport == "nixl" and transport != "nixl":
        message = (
            f"the spec asks for nixl but decode {decode} uses {transport or 'an unreported'} "
            f"transport (NIXL unavailable, it fell back); the hand-off works: {measured}"
        )
        return result(False, "TransportFellBack", message)
    message = f"{prefill} -> {decode} over {transport or 'an unreported transport'}: {measured}"
    return result(True, "CanaryHandOffSucceeded", message)
