"""The prefill→decode hand-off against fake engines that check the `kv_transfer_params`
contract, and each conditional-disaggregation outcome, counted."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from baton.router.handoff import decode_body, prefill_body
from tests.router.harness import FakeCluster, RouterServer, routed

LONG = "The relay team passes the baton in a marked zone. " * 8  # ~400 characters
OUTCOMES = ("disaggregated", "skipped_short", "skipped_cached", "decode_only_fallback", "failed")


def _outcomes(router: RouterServer) -> dict[str, float]:
    name = "baton:router_disagg_decisions_total"
    return {o: router.metric(name, outcome=o) for o in OUTCOMES}


def _only(outcome: str, count: int) -> dict[str, float]:
    return {o: float(count if o == outcome else 0) for o in OUTCOMES}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_prefill_and_decode_bodies_follow_the_contract() -> None:
    """Step 1 asks for one token, unstreamed, kept for a remote decode; step 2 is the original
    request with the prefill's params and do_remote_prefill."""
    chat = {"messages": [], "max_completion_tokens": 50, "stream": True, "min_tokens": 3,
            "stream_options": {"include_usage": True}, "n": 2}  # fmt: skip
    step1 = prefill_body("/v1/chat/completions", chat)
    assert step1["max_tokens"] == 1 and step1["max_completion_tokens"] == 1
    assert step1["stream"] is False and "stream_options" not in step1
    assert step1["kv_transfer_params"] == {"do_remote_decode": True}
    assert step1["min_tokens"] == 0 and step1["n"] == 1
    step2 = decode_body(chat, {"remote_request_id": "r1"})
    assert step2["kv_transfer_params"] == {"remote_request_id": "r1", "do_remote_prefill": True}
    assert step2["max_completion_tokens"] == 50 and step2["stream"] is True


@pytest.mark.parametrize("stream", [False, True])
def test_disaggregated_answers_equal_aggregated_ones(cluster: FakeCluster, stream: bool) -> None:
    """Through 1 prefill + 1 decode engine, completions and chats equal an aggregated engine's
    answers, the decode engine read the prefill engine's lease, and each is counted."""
    prefill, _ = cluster.add("prefill")
    decode, _ = cluster.add("decode")
    reference = FakeCluster()
    _, aggregated = reference.add("both")
    try:
        with routed(cluster, decode_policy="round-robin") as router:
            via, direct = _client(router.url), _client(aggregated.url)
            for i in range(2):
                prompt = f"request {i}: {LONG}"
                kwargs: Any = {"model": "fake", "prompt": prompt, "max_tokens": 6}
                if stream:
                    texts = [
                        c.choices[0].text
                        for c in via.completions.create(stream=True, **kwargs)
                        if c.choices
                    ]
                    got = "".join(texts)
                else:
                    got = via.completions.create(**kwargs).choices[0].text
                assert got == direct.completions.create(**kwargs).choices[0].text
            messages: Any = [{"role": "user", "content": LONG}]
            chat = via.chat.completions.create(model="fake", messages=messages, max_tokens=4)
            want = direct.chat.completions.create(model="fake", messages=messages, max_tokens=4)
            assert chat.choices[0].message.content == want.choices[0].message.content
            assert prefill.prefills == 3 and decode.remote_decodes == 3
            assert _outcomes(router) == _only("disaggregated", 3)
    finally:
        reference.stop()


def test_short_prompts_skip_the_prefill_engine(cluster: FakeCluster) -> None:
    """A prompt estimated under --disagg-min-tokens goes to the decode engine alone."""
    prefill, _ = cluster.add("prefill")
    decode, _ = cluster.add("decode")
    with routed(cluster, disagg_min_tokens=200) as router:
        _client(router.url).completions.create(model="fake", prompt="short", max_tokens=2)
        assert prefill.requests == [] and len(decode.requests) == 1
        assert "kv_transfer_params" not in decode.requests[0]
        _client(router.url).completions.create(model="fake", prompt=LONG * 2, max_tokens=2)
        assert prefill.prefills == 1
        assert _outcomes(router) == {**_only("skipped_short", 1), "disaggregated": 1.0}


def test_prompts_cached_on_the_decode_engine_skip_the_prefill(cluster: FakeCluster) -> None:
    """A prompt whose blocks the decode engine already holds is not prefilled again."""
    prefill, _ = cluster.add("prefill")
    cluster.add("decode")
    with routed(cluster) as router:
        client = _client(router.url)
        client.completions.create(model="fake", prompt=LONG, max_tokens=2)
        client.completions.create(model="fake", prompt=LONG + " and more", max_tokens=2)
        assert prefill.prefills == 1
        assert _outcomes(router) == {**_only("disaggregated", 1), "skipped_cached": 1.0}


@pytest.mark.parametrize("policy", ["decode", "fail"])
def test_no_prefill_engine_follows_on_no_prefill(cluster: FakeCluster, policy: str) -> None:
    """With every prefill engine down, `decode` serves on the decode engine alone and `fail`
    answers 503; either way the decision is counted."""
    _, prefill_server = cluster.add("prefill")
    decode, _ = cluster.add("decode")
    with routed(cluster, on_no_prefill=policy) as router:
        prefill_server.stop()
        answers = [
            httpx.post(
                f"{router.url}/v1/completions",
                json={"model": "fake", "prompt": f"{i} {LONG}", "max_tokens": 2},
            )
            for i in range(3)
        ]
        if policy == "decode":
            assert [a.status_code for a in answers] == [200] * 3
            assert len(decode.requests) == 3
            assert _outcomes(router) == _only("decode_only_fallback", 3)
        else:
            assert [a.status_code for a in answers] == [503] * 3
            assert "prefill" in answers[0].json()["error"]["message"]
            assert decode.requests == []
            assert _outcomes(router) == _only("failed", 3)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_several_samples_are_computed_on_the_decode_engine(
    cluster: FakeCluster, route: str
) -> None:
    """`n` > 1 is never handed off (one prompt's KV serves one sample; the engines refuse
    more): the decode engine computes the prompt and every sample, and the choice is
    counted. `n` = 1 is handed off as ever."""
    prefill, _ = cluster.add("prefill")
    decode, _ = cluster.add("decode")
    body: dict[str, Any] = {"model": "fake", "max_tokens": 2}
    if route == "/v1/completions":
        body["prompt"] = LONG
    else:
        body["messages"] = [{"role": "user", "content": LONG}]
    with routed(cluster) as router:
        several = httpx.post(f"{router.url}{route}", json={**body, "n": 2})
        assert several.status_code == 200, several.text
        assert prefill.requests == []
        assert decode.requests[0]["n"] == 2 and "kv_transfer_params" not in decode.requests[0]
        assert _outcomes(router) == _only("decode_only_fallback", 1)
        other = (
            {"prompt": f"other {LONG}"}
            if route == "/v1/completions"
            else {"messages": [{"role": "user", "content": f"other {LONG}"}]}
        )  # not cached on the decode engine by the first
        one = httpx.post(f"{router.url}{route}", json={**body, **other, "n": 1})
        assert one.status_code == 200 and prefill.prefills == 1


def test_a_prefill_answer_without_params_falls_back_visibly(cluster: FakeCluster) -> None:
    """A prefill engine that answers without kv_transfer_params: decode alone, counted."""
    prefill, _ = cluster.add("prefill")
    decode, _ = cluster.add("decode")
    prefill.omit_kv_params = True
    with routed(cluster) as router:
        _client(router.url).completions.create(model="fake", prompt=LONG, max_tokens=2)
        assert "kv_transfer_params" not in decode.requests[0]
        assert _outcomes(router) == _only("decode_only_fallback", 1)


def test_a_bad_prompt_reaches_the_client_from_the_prefill_engine(cluster: FakeCluster) -> None:
    """A 400 from the prefill engine is the client's answer (not retried, not decoded)."""
    prefill, _ = cluster.add("prefill")
    decode, _ = cluster.add("decode")
    prefill.fail_status = 400
    with routed(cluster) as router:
        r = httpx.post(f"{router.url}/v1/completions", json={"model": "fake", "prompt": LONG})
        assert r.status_code == 400 and decode.requests == []
        assert _outcomes(router) == _only("failed", 1)


def test_a_batch_of_prompts_is_decoded_alone(cluster: FakeCluster) -> None:
    """A completions batch cannot share one set of params: decode alone, counted."""
    prefill, _ = cluster.add("prefill")
    cluster.add("decode")
    with routed(cluster) as router:
        body = {"model": "fake", "prompt": [LONG, LONG + "b"], "max_tokens": 2}
        assert httpx.post(f"{router.url}/v1/completions", json=body).status_code == 200
        assert prefill.requests == []
        assert _outcomes(router) == _only("decode_only_fallback", 1)


def test_a_failed_prefill_engine_is_retried_on_another(cluster: FakeCluster) -> None:
    """With one of two prefill engines answering 503, every request is still disaggregated."""
    bad, _ = cluster.add("prefill")
    good, _ = cluster.add("prefill")
    cluster.add("decode")
    bad.fail_status = 503
    with routed(cluster, prefill_policy="round-robin", disagg_cached_fraction=1.0) as router:
        client = _client(router.url)
        for i in range(4):
            client.completions.create(model="fake", prompt=f"{i} {LONG}", max_tokens=2)
        assert good.prefills == 4
        assert _outcomes(router) == _only("disaggregated", 4)


def test_killing_one_decode_engine_moves_requests_to_the_other(cluster: FakeCluster) -> None:
    """Two decode engines, one stopped mid-run: later requests all succeed on the other."""
    cluster.add("prefill")
    first, first_server = cluster.add("decode")
    second, _ = cluster.add("decode")
    with routed(cluster, decode_policy="round-robin") as router:
        client = _client(router.url)
        for i in range(4):
            client.completions.create(model="fake", prompt=f"{i} {LONG}", max_tokens=2)
        assert len(first.requests) == 2 and len(second.requests) == 2
        first_server.stop()
        for i in range(6):
            answer = client.completions.create(model="fake", prompt=f"x{i} {LONG}", max_tokens=2)
            assert answer.choices[0].text
        assert len(second.requests) == 8


@pytest.mark.parametrize("on_no_prefill", ["decode", "fail"])
def test_hand_offs_pair_engines_of_equal_tensor_parallel_size(
    cluster: FakeCluster, on_no_prefill: str
) -> None:
    """KV blocks move only between engines of equal tensor_parallel_size (their /health says):
    a decode engine of 2 gets its prefill from the prefill engine of 2, never the one of 1; a
    decode engine of 4, with no prefill engine of 4, follows --on-no-prefill, counted."""
    one, _ = cluster.add("prefill")
    two, _ = cluster.add("prefill")
    decode, _ = cluster.add("decode")
    lone, _ = cluster.add("decode", model="other")
    cluster.add("prefill", model="other")[0].tensor_parallel_size = 1
    one.tensor_parallel_size, two.tensor_parallel_size = 1, 2
    decode.tensor_parallel_size, lone.tensor_parallel_size = 2, 4
    with routed(
        cluster, prefill_policy="round-robin", disagg_cached_fraction=1.0,
        on_no_prefill=on_no_prefill,
    ) as router:  # fmt: skip
        client = _client(router.url)
        for i in range(4):
            client.completions.create(model="fake", prompt=f"{i} {LONG}", max_tokens=2)
        assert (one.prefills, two.prefills) == (0, 4)
        r = httpx.post(
            f"{router.url}/v1/completions", json={"model": "other", "prompt": LONG}, timeout=10
        )
        if on_no_prefill == "decode":
            assert r.status_code == 200 and lone.requests
            assert _outcomes(router) == {**_only("disaggregated", 4), "decode_only_fallback": 1}
        else:
            assert r.status_code == 503
            assert "tensor_parallel_size 4" in r.json()["error"]["message"]
            assert _outcomes(router) == {**_only("disaggregated", 4), "failed": 1}
