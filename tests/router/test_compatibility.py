"""The router pairs a prefill engine with a decode engine only when their compatibility
fingerprints (from /health) are equal, or one is unknown: a rollout's old and new engines hand
off among themselves, a decode engine without a compatible prefill follows --on-no-prefill, and
/engines and baton:router_compatible_pairs say which pairs exist."""

from __future__ import annotations

import logging
import random
import time

import httpx
import openai
import pytest

from baton.roles import Role
from tests.router.harness import FakeCluster, RouterServer, routed
from tests.support.fake_engine import FakeEngine

LONG = "Only engines that agree on what a KV block means may hand one off. " * 6
OLD, NEW = "a" * 32, "b" * 32  # the fingerprints of two releases
PAIRS = "baton:router_compatible_pairs"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _outcome(router: RouterServer, outcome: str) -> float:
    return router.metric("baton:router_disagg_decisions_total", outcome=outcome)


def _add(
    cluster: FakeCluster, role: Role, fingerprint: str | None, model: str = "fake"
) -> FakeEngine:
    engine, _ = cluster.add(role, model)
    engine.fingerprint = fingerprint
    return engine


def test_a_rollout_hands_off_old_to_old_and_new_to_new(cluster: FakeCluster) -> None:
    """Old and new engines mixed (3 prefill and 4 decode engines of two fingerprints): over 80
    requests, streamed or not, every hand-off stays within one fingerprint, both releases serve,
    and no decode engine ever sees a lease of the other release."""
    prefills = [_add(cluster, "prefill", fp) for fp in (OLD, OLD, NEW)]
    decodes = [_add(cluster, "decode", fp) for fp in (OLD, NEW, NEW, OLD)]
    fingerprint_of = {p.engine_id: p.fingerprint for p in prefills}
    rng = random.Random(15)
    with routed(
        cluster, prefill_policy="round-robin", decode_policy="least-load",
        disagg_cached_fraction=1.0,
    ) as router:  # fmt: skip
        client = _client(router.url)
        for i in range(80):
            prompt = f"{i} {rng.random()} {LONG}"
            if i % 3 == 0:
                chunks = client.completions.create(
                    model="fake", prompt=prompt, max_tokens=3, stream=True
                )
                assert "".join(c.choices[0].text for c in chunks if c.choices)
            else:
                assert client.completions.create(model="fake", prompt=prompt, max_tokens=3)
        assert _outcome(router, "disaggregated") == 80
    for decode in decodes:
        assert decode.read_from, "every decode engine took hand-offs"
        assert {fingerprint_of[e] for e in decode.read_from} == {decode.fingerprint}
        assert len(decode.read_from) == len(decode.requests)  # no refused lease, no fallback
    assert all(p.prefills for p in prefills)


def test_an_unknown_fingerprint_pairs_as_before(cluster: FakeCluster) -> None:
    """An engine of an older Baton says no fingerprint: it pairs with any engine."""
    prefill = _add(cluster, "prefill", None)
    decode = _add(cluster, "decode", NEW)
    with routed(cluster, disagg_cached_fraction=1.0) as router:
        for i in range(3):
            _client(router.url).completions.create(model="fake", prompt=f"{i}{LONG}", max_tokens=2)
        assert prefill.prefills == 3 and decode.remote_decodes == 3
        assert router.metric(PAIRS, model="fake") == 1


def test_a_decode_engine_with_a_compatible_prefill_is_preferred(cluster: FakeCluster) -> None:
    """A new decode engine up before any new prefill engine gets no hand-off it cannot read:
    requests go to the old decode engine, which can pair, all disaggregated."""
    _add(cluster, "prefill", OLD)
    old = _add(cluster, "decode", OLD)
    new = _add(cluster, "decode", NEW)
    with routed(cluster, decode_policy="round-robin", disagg_cached_fraction=1.0) as router:
        for i in range(6):
            _client(router.url).completions.create(model="fake", prompt=f"{i}{LONG}", max_tokens=2)
        assert old.remote_decodes == 6 and new.requests == []
        assert _outcome(router, "disaggregated") == 6


@pytest.mark.parametrize("on_no_prefill", ["decode", "fail"])
def test_no_compatible_pair_follows_on_no_prefill(
    cluster: FakeCluster, on_no_prefill: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A model whose only prefill engine disagrees with its decode engine: `decode` serves the
    request on the decode engine alone, `fail` answers 503 naming the fingerprints; neither sends
    a hand-off, both are counted and logged once."""
    prefill = _add(cluster, "prefill", OLD)
    decode = _add(cluster, "decode", NEW)
    caplog.set_level(logging.WARNING, logger="baton.router.handoff")
    with routed(cluster, on_no_prefill=on_no_prefill) as router:
        answers = [
            httpx.post(
                f"{router.url}/v1/completions",
                json={"model": "fake", "prompt": f"{i} {LONG}", "max_tokens": 2},
                timeout=10,
            )
            for i in range(3)
        ]
        assert prefill.requests == [] and decode.read_from == []
        if on_no_prefill == "decode":
            assert [a.status_code for a in answers] == [200] * 3
            assert len(decode.requests) == 3
            assert _outcome(router, "decode_only_fallback") == 3
        else:
            assert [a.status_code for a in answers] == [503] * 3
            message = answers[0].json()["error"]["message"]
            assert f"fingerprint {NEW}" in message and "--on-no-prefill=fail" in message
            assert decode.requests == [] and _outcome(router, "failed") == 3
    warnings = [r.getMessage() for r in caplog.records if "no compatible" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert NEW in warnings[0] and OLD in warnings[0]


def test_engines_and_metrics_show_fingerprints_and_pairs(cluster: FakeCluster) -> None:
    """/engines shows each engine's fingerprint and parts, and per model whether a compatible
    pair exists; the gauge counts the pairs and follows an engine whose fingerprint changes."""
    prefill = _add(cluster, "prefill", OLD)
    _add(cluster, "decode", OLD)
    _add(cluster, "decode", NEW)
    _add(cluster, "prefill", OLD, model="other")
    _add(cluster, "decode", NEW, model="other")
    _add(cluster, "both", None, model="solo")
    with routed(cluster) as router:
        body = httpx.get(f"{router.url}/engines").json()
        fingerprints = sorted(str(e["fingerprint"]) for e in body["engines"])
        assert fingerprints == sorted([OLD, OLD, NEW, OLD, NEW, "None"])
        mine = next(e for e in body["engines"] if e["url"] == f"http://127.0.0.1:{prefill.port}")
        assert mine["compatibility"] == {"weights": "aaaaaaaa", "block_size": 16}
        assert len(mine["pairs_with"]) == 1
        assert body["models"]["fake"] == {"compatible_pairs": 1, "compatible_pair": True}
        assert body["models"]["other"] == {"compatible_pairs": 0, "compatible_pair": False}
        assert "solo" not in body["models"]  # aggregated engines hand nothing off
        assert router.metric(PAIRS, model="fake") == 1
        assert router.metric(PAIRS, model="other") == 0
        assert f"# HELP {PAIRS} " in httpx.get(f"{router.url}/metrics").text
        prefill.fingerprint = NEW  # the prefill engine restarted on the new release
        deadline = time.monotonic() + 5
        while router.metric(PAIRS, model="fake") != 1 or _pairs_with(router, OLD) != 0:
            assert time.monotonic() < deadline, httpx.get(f"{router.url}/engines").text
            time.sleep(0.05)


def _pairs_with(router: RouterServer, fingerprint: str) -> int:
    """How many counterparts the decode engine of `fingerprint` (model fake) can pair with."""
    for engine in httpx.get(f"{router.url}/engines").json()["engines"]:
        if engine["fingerprint"] == fingerprint and engine["role"] == "decode":
            return len(engine["pairs_with"])
    raise AssertionError(f"no decode engine of fingerprint {fingerprint}")
