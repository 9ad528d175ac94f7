"""Compatibility over real processes: one prefill engine and two decode engines of the tiny
model, one of them with other weights of the same shape (so another fingerprint in its /health),
behind the real router. Every hand-off goes to the decode engine that agrees, and its answers
equal the single engine's; the other decode engine never pairs, and alone behind the router it
follows --on-no-prefill instead of decoding from foreign KV.

Needs the engines' `fingerprint` in /health (the engine side of issue 15): without it the
router pairs every engine, as before, and this test fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from baton.operator.kv_probe import Engine, ProbeResult, probe
from tests.e2e.conftest import (
    COMMON,
    Fleet,
    RouterProc,
    complete,
    open_stream,
    prompt_ids,
    tokens,
)
from tests.support.engine_server import Server, start_all, stop_all
from tests.support.thread_server import scrape

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def foreign(
    fleet: Fleet, tiny_model: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A decode engine like the fleet's d0 but for weights of another seed: same shapes, same
    block size, blocks that mean something else."""
    model = Path(tiny_model("llama", seed=15))
    tmp = tmp_path_factory.mktemp("foreign")
    servers = start_all(model, tmp, {"d_foreign": (*COMMON, "--role", "decode")})
    try:
        yield servers["d_foreign"]
    finally:
        stop_all(servers.values(), drain_seconds=0.5)


def _requests_served(server: Server) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("vllm:request_success"))


def _engines(router: RouterProc) -> dict[str, Any]:
    return dict(httpx.get(f"{router.url}/engines", timeout=5).json())


def test_only_engines_that_agree_hand_off(
    fleet: Fleet, foreign: Server, make_router: Callable[..., RouterProc]
) -> None:
    """With p0, d0 and the foreign decode engine behind one router (decode round-robin): 6
    answers, 2 streamed, all handed off p0 -> d0 and equal to d0's own; the foreign engine served
    nothing and /engines and the gauge show it pairs with no prefill engine."""
    p0, d0 = fleet["p0"], fleet["d0"]
    fingerprints = {
        s.url: httpx.get(f"{s.url}/health").json().get("fingerprint") for s in (p0, d0, foreign)
    }
    assert fingerprints[p0.url] == fingerprints[d0.url] != fingerprints[foreign.url]
    assert fingerprints[p0.url] is not None and fingerprints[foreign.url] is not None
    before = _requests_served(foreign)
    router = make_router([p0], [d0, foreign], "--decode-policy", "round-robin")
    for i in range(6):
        prompt = prompt_ids(1500 + i, 40)
        want = tokens(complete(d0.url, prompt))
        if i % 3 == 2:
            stream = open_stream(router.url, prompt, 8)
            headers = stream.response.headers
            how, got = stream.finish()
            assert how == "done", got
        else:
            r = complete(router.url, prompt)
            headers, got = r.headers, tokens(r)
        assert got == want, i
        assert headers["x-baton-engine"] == d0.url
        assert headers["x-baton-prefill-engine"] == p0.url
    assert _requests_served(foreign) == before
    seen = {e["url"]: e for e in _engines(router)["engines"]}
    assert seen[foreign.url]["fingerprint"] == fingerprints[foreign.url]
    assert seen[foreign.url]["pairs_with"] == [] and seen[d0.url]["pairs_with"] == [p0.url]
    assert _engines(router)["models"]["tiny"] == {"compatible_pairs": 1, "compatible_pair": True}
    assert scrape(router.url, "baton:router_compatible_pairs", model="tiny") == 1
    outcomes = "baton:router_disagg_decisions_total"
    assert scrape(router.url, outcomes, outcome="disaggregated") == 6


def test_no_compatible_pair_never_hands_off(
    fleet: Fleet, foreign: Server, make_router: Callable[..., RouterProc]
) -> None:
    """p0 and the foreign decode engine alone: the default (--on-no-prefill fail) answers 503
    naming the decode engine's fingerprint; `decode` serves on the foreign engine alone, its own
    answer (not one decoded from p0's blocks), and p0 never prefills; the gauge says 0."""
    p0 = fleet["p0"]
    prompt = prompt_ids(1600, 40)
    want = tokens(complete(foreign.url, prompt))
    prefilled = _requests_served(p0)
    strict = make_router([p0], [foreign])
    r = complete(strict.url, prompt)
    assert r.status_code == 503, r.text
    assert "fingerprint" in r.json()["error"]["message"]
    assert scrape(strict.url, "baton:router_compatible_pairs", model="tiny") == 0
    assert _engines(strict)["models"]["tiny"]["compatible_pair"] is False
    lenient = make_router([p0], [foreign], "--on-no-prefill", "decode")
    r = complete(lenient.url, prompt)
    assert tokens(r) == want and r.headers["x-baton-engine"] == foreign.url
    assert "x-baton-prefill-engine" not in r.headers
    outcome = "baton:router_disagg_decisions_total"
    assert scrape(lenient.url, outcome, outcome="decode_only_fallback") == 1
    assert _requests_served(p0) == prefilled
    assert "no compatible prefill engine" in lenient.log()


def test_the_operators_canary_hands_off_between_real_engines(fleet: Fleet, foreign: Server) -> None:
    """The operator's KVPathReady probe against real engine processes: p0 -> d0 succeeds with
    the transport in use and the bytes the pull moved; p0 -> the foreign engine is refused as
    IncompatibleEngines before any request."""

    async def run() -> tuple[ProbeResult, ProbeResult]:
        p0, d0 = (Engine("127.0.0.1", fleet[n].port) for n in ("p0", "d0"))
        stranger = Engine("127.0.0.1", foreign.port)
        async with aiohttp.ClientSession() as session:
            ok = await probe(session, p0, d0, "tiny", "tcp", None)
            refused = await probe(session, p0, stranger, "tiny", "tcp", None)
        return ok, refused

    ok, refused = asyncio.run(run())
    assert ok.ok and ok.reason == "CanaryHandOffSucceeded", ok.message
    assert ok.transport == "tcp" and (ok.num_bytes or 0) > 0 and (ok.gb_per_second or 0) > 0
    assert not refused.ok and refused.reason == "IncompatibleEngines", refused.message
