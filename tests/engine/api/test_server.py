"""End to end: the real engine server in a subprocess (API server + EngineCore processes), driven
by the official `openai` client and plain HTTP, compared with the offline `LLM`: routes, outputs,
errors and metrics. Load, aborts, drain and engine death are in test_server_lifecycle.py."""

from __future__ import annotations

import asyncio
import json
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from baton import LLM, SamplingParams
from baton.engine.api import responses as r
from tests.support.engine_server import (
    MAX_MODEL_LEN,
    NAME,
    Server,
    expect_error,
    start_server,
)

PROMPTS = ["The relay team passed the baton", "Paged attention stores", "Hello"]
NEAR_TIE = 1e-4  # logprob gap under which a different batch may legitimately pick either token

pytestmark = pytest.mark.slow  # every test here needs a server process: seconds to start


@pytest.fixture(scope="module")
def offline(model: Path) -> LLM:
    return LLM(str(model), max_model_len=MAX_MODEL_LEN)


def _assert_same_greedy(ours: list[int], out: Any) -> None:
    """Token for token, up to a near-tie in the offline logprobs (batches differ in rounding)."""
    sample = out.outputs[0]
    assert len(ours) == len(sample.token_ids)
    for i, (a, b) in enumerate(zip(ours, sample.token_ids, strict=True)):
        if a != b:
            entry = sample.logprobs[i]
            assert a in entry and abs(entry[a].logprob - entry[b].logprob) < NEAR_TIE, (
                f"token {i}: server {a}, offline {b}; server {ours}, offline {sample.token_ids}"
            )
            return


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


# ---- correctness ---------------------------------------------------------------------------


def test_greedy_completions_match_offline_llm(server: Server, offline: LLM) -> None:
    """A batch of greedy completions equals the offline LLM's tokens and text; usage is right."""
    expected = offline.generate(PROMPTS, _greedy(12))
    resp = server.client().completions.create(
        model=NAME,
        prompt=PROMPTS,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert resp.id.startswith("cmpl-") and resp.model == NAME
    for choice, out in zip(resp.choices, expected, strict=True):
        extra = choice.model_extra or {}
        assert extra["prompt_token_ids"] == out.prompt_token_ids
        _assert_same_greedy(extra["token_ids"], out)
        if extra["token_ids"] == out.outputs[0].token_ids:
            assert choice.text == out.outputs[0].text
        assert choice.finish_reason == "length"
    assert resp.usage is not None
    prompt_tokens = sum(len(o.prompt_token_ids) for o in expected)
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == 12 * len(PROMPTS)
    assert resp.usage.total_tokens == prompt_tokens + 12 * len(PROMPTS)


def test_async_stream_equals_non_stream(server: Server) -> None:
    """Streamed text (async client) joins to the non-streamed text; usage comes last."""
    client = server.client()
    args: dict[str, Any] = dict(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    full = client.completions.create(**args)

    async def stream() -> tuple[str, list[Any]]:
        async with server.async_client() as aclient:
            chunks = [
                c
                async for c in await aclient.completions.create(
                    **args, stream=True, stream_options={"include_usage": True}
                )
            ]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks

    text, chunks = asyncio.run(stream())
    assert text == full.choices[0].text
    assert chunks[-1].choices == []
    # The counts agree; cached_tokens may not (the stream can hit the blocks `full` cached).
    usage, full_usage = chunks[-1].usage, full.usage
    assert usage is not None and full_usage is not None
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == full_usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("with_ids", [False, True], ids=["text", "text-and-token-ids"])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_streamed_events_are_the_chunk_models_own_rendering(
    server: Server, route: str, with_ids: bool
) -> None:
    """Every event of a stream, those whose text (and token ids, as the router asks for them)
    the server splices into a template included (`responses.TextEvents`), is byte for byte what
    the chunk's models render from its own content; the events' text and ids join to the whole
    answer's."""
    chunk_model: Any = r.CompletionChunk if route == "completions" else r.ChatCompletionChunk
    body: dict[str, Any] = {"model": NAME, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    if route == "completions":
        body["prompt"] = PROMPTS[0]
    else:
        body["messages"] = [{"role": "user", "content": PROMPTS[0]}]
    if with_ids:
        body["return_token_ids"] = True
    whole = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30).json()["choices"][0]
    with httpx.stream(
        "POST", f"{server.url}/v1/{route}", json={**body, "stream": True}, timeout=30
    ) as response:
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    texts, ids = [], []
    for event in events[:-2]:
        chunk = chunk_model.model_validate_json(event.removeprefix("data: "))
        assert r.sse(chunk) == event + "\n\n"
        for choice in chunk.choices:
            texts.append(choice.text if route == "completions" else choice.delta.content or "")
            ids += choice.token_ids or []
    assert "".join(texts) == (
        whole["text"] if route == "completions" else whole["message"]["content"]
    )
    assert len(texts) > 1  # in pieces (a busy server merges what a slow reader has not read)
    assert ids == (whole["token_ids"] if with_ids else [])


def test_a_reader_that_stalls_gets_every_event_in_order(server: Server) -> None:
    """A client that stops reading mid-answer: the engine's output loop writes the stream's
    events itself while the connection takes them, and its task sends them (waiting for the
    client to drain) once it does not (whether the buffers fill before this answer ends is the
    kernel's to say; `test_direct_writes` refuses writes at set points). Nothing is lost or
    reordered: the events' tokens and text join to the non-streamed answer's."""
    body: dict[str, Any] = {
        "model": NAME,
        "prompt": PROMPTS[0],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,  # large events
        "return_token_ids": True,
    }
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        time.sleep(1)  # the client reads nothing meanwhile
        events = response.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert sum(len(json.dumps(c)) for c in chunks) > 100_000
    choice = whole["choices"][0]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_continues_the_final_message(server: Server, offline: LLM) -> None:
    """`continue_final_message` (vLLM's) renders the last message open: the prompt is
    `LLM.chat`'s with it (and /tokenize's), with no end of turn after the assistant's text,
    and the answer goes on from there (with `echo`, starting with that text, as vLLM's);
    asking for the generation prompt too is a 400."""
    messages: Any = [
        {"role": "user", "content": "Pass the baton"},
        {"role": "assistant", "content": "The baton goes"},
    ]
    expected = offline.chat(
        messages, _greedy(8), add_generation_prompt=False, continue_final_message=True
    )[0]
    whole = offline.chat(messages, _greedy(8), add_generation_prompt=False)[0]
    assert expected.prompt_token_ids != whole.prompt_token_ids  # the turn is left open
    body: dict[str, Any] = {
        "model": NAME,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "continue_final_message": True,
    }
    for flags in ({"add_generation_prompt": False}, {}):  # the prompt's default gives way
        resp = httpx.post(f"{server.url}/v1/chat/completions", json={**body, **flags}, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.json()["prompt_token_ids"] == expected.prompt_token_ids
        _assert_same_greedy(resp.json()["choices"][0]["token_ids"], expected)
    # vLLM's chat echo: the answer starts with the message it continues, whole or streamed
    answer = resp.json()["choices"][0]["message"]["content"]
    echoed = httpx.post(
        f"{server.url}/v1/chat/completions", json={**body, "echo": True}, timeout=30
    ).json()["choices"][0]["message"]["content"]
    assert echoed == "The baton goes" + answer
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={**body, "echo": True, "stream": True},
        timeout=30,
    ) as streamed:
        events = [json.loads(x[6:]) for x in streamed.iter_lines() if x.startswith("data: {")]
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
    assert deltas[1] == "The baton goes" and "".join(deltas) == echoed
    opened = {**body, "messages": messages[:1], "continue_final_message": False, "echo": True}
    fresh = httpx.post(f"{server.url}/v1/chat/completions", json=opened, timeout=30).json()
    assert not fresh["choices"][0]["message"]["content"].startswith("Pass the baton")
    tokenized = httpx.post(
        f"{server.url}/tokenize",
        json={"model": NAME, "messages": messages, "continue_final_message": True},
        timeout=30,
    )
    assert tokenized.json()["tokens"] == expected.prompt_token_ids
    both = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={**body, "add_generation_prompt": True},
        timeout=30,
    )
    error = expect_error(both, 400)
    assert (
        "Cannot set both `continue_final_message` and `add_generation_prompt`" in error["message"]
    )


def test_the_answers_role_is_the_last_messages_without_a_generation_prompt(
    server: Server,
) -> None:
    """vLLM's rule: after a generation prompt the answer is the assistant's; without one it goes
    on as the last message's author, and says so, whole and streamed (and with `echo`, starts
    with that message's text)."""
    body: dict[str, Any] = {"model": NAME, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    cases = [
        ([{"role": "user", "content": "Pass the"}], {}, "assistant", ""),
        ([{"role": "user", "content": "Pass the"}], {"add_generation_prompt": False}, "user",
         "Pass the"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}],
         {"continue_final_message": True}, "assistant", "The"),
    ]  # fmt: skip
    for messages, flags, role, echoed in cases:
        request = {**body, "messages": messages, "echo": True, **flags}
        whole = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=30)
        message = whole.json()["choices"][0]["message"]
        assert message["role"] == role, (flags, message)
        assert message["content"].startswith(echoed)
        with httpx.stream(
            "POST",
            f"{server.url}/v1/chat/completions",
            json={**request, "stream": True},
            timeout=30,
        ) as streamed:
            events = [json.loads(x[6:]) for x in streamed.iter_lines() if x.startswith("data: {")]
        assert events[0]["choices"][0]["delta"] == {"role": role, "content": ""}
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        assert text == message["content"]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server: Server) -> None:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens are the prompt (completions
    and chat alike), the answer is the answer to those alone; -1 keeps what the model takes;
    0, below -1 or above max_model_len is a 400."""
    url = f"{server.url}/v1"
    ids = list(range(10, 40))
    greedy: dict[str, Any] = {"model": NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    greedy["return_token_ids"] = True
    cut = httpx.post(
        f"{url}/completions", json={**greedy, "prompt": ids, "truncate_prompt_tokens": 7}
    ).json()["choices"][0]
    alone = httpx.post(f"{url}/completions", json={**greedy, "prompt": ids[-7:]}).json()
    assert cut["prompt_token_ids"] == ids[-7:]
    assert cut["token_ids"] == alone["choices"][0]["token_ids"]
    echoed = httpx.post(
        f"{url}/completions",
        json={
            **greedy,
            "prompt": "The relay team passed the baton",
            "echo": True,
            "truncate_prompt_tokens": 3,
        },
    ).json()["choices"][0]
    kept = httpx.post(
        f"{server.url}/detokenize", json={"model": NAME, "tokens": echoed["prompt_token_ids"]}
    ).json()["prompt"]
    assert len(echoed["prompt_token_ids"]) == 3 and echoed["text"].startswith(kept)
    assert "The relay" not in echoed["text"]
    messages = [{"role": "user", "content": "Pass the baton, and quickly"}]
    full = httpx.post(f"{server.url}/tokenize", json={"model": NAME, "messages": messages})
    chat = httpx.post(
        f"{url}/chat/completions",
        json={**greedy, "messages": messages, "truncate_prompt_tokens": 5},
    ).json()
    assert chat["prompt_token_ids"] == full.json()["tokens"][-5:]
    whole = httpx.post(
        f"{url}/completions", json={**greedy, "prompt": ids, "truncate_prompt_tokens": -1}
    ).json()["choices"][0]
    assert whole["prompt_token_ids"] == ids
    for k in (0, -2, MAX_MODEL_LEN + 1):
        refused = httpx.post(
            f"{url}/completions", json={**greedy, "prompt": ids, "truncate_prompt_tokens": k}
        )
        assert "truncate_prompt_tokens" in expect_error(refused, 400)["message"], k
    beams = httpx.post(
        f"{url}/completions", json={**greedy, "prompt": ids, "use_beam_search": True}
    )
    assert "beam search" in expect_error(beams, 400)["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_show_token_ids_when_asked(server: Server, stream: bool) -> None:
    """vLLM's `return_tokens_as_token_ids`: every token in the logprobs, sampled or among the
    top ones, echoed or not, is `token_id:<id>` (its bytes those of that string in chat), the
    ids those of the answer; the text is unchanged."""
    base: dict[str, Any] = {"model": NAME, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    base |= {"return_token_ids": True, "return_tokens_as_token_ids": True, "stream": stream}

    def answers(route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        url = f"{server.url}/v1/{route}"
        if not stream:
            return [httpx.post(url, json=body, timeout=30).json()["choices"][0]]
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
        return [c for c in (json.loads(line)["choices"] for line in lines) for c in c]

    body = {**base, "prompt": PROMPTS[0], "logprobs": 2, "echo": not stream}
    choices = answers("completions", body)
    tokens = [t for c in choices if c.get("logprobs") for t in c["logprobs"]["tokens"]]
    ids = [t for c in choices for t in (c.get("prompt_token_ids") or []) if not stream]
    ids += [t for c in choices for t in c.get("token_ids") or []]
    assert tokens == [f"token_id:{t}" for t in ids]
    tops = [
        k
        for c in choices
        if c.get("logprobs")
        for top in c["logprobs"]["top_logprobs"]
        if top
        for k in top
    ]
    assert tops and all(k.startswith("token_id:") for k in tops)
    chat_body = {**base, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
    chat = answers("chat/completions", {**chat_body, "top_logprobs": 2})
    entries = [e for c in chat if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert [e["token"] for e in entries] == [
        f"token_id:{t}" for c in chat for t in c.get("token_ids") or []
    ]
    for e in entries:
        assert e["bytes"] == list(e["token"].encode())
        assert all(t["token"].startswith("token_id:") for t in e["top_logprobs"])


def test_stop_string_is_cut_with_finish_reason_stop(server: Server, offline: LLM) -> None:
    """A stop string found in the output ends the text just before it, streamed or not."""
    text = offline.generate(PROMPTS[1], _greedy(40))[0].outputs[0].text
    start = next(
        k
        for k in range(1, len(text) - 3)
        if "\ufffd" not in text[k : k + 3] and text.find(text[k : k + 3]) == k
    )
    stop = text[start : start + 3]
    client = server.client()
    args: dict[str, Any] = dict(
        model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop]
    )
    resp = client.completions.create(**args)
    choice = resp.choices[0]
    assert choice.text == text[:start] and choice.finish_reason == "stop"
    assert (choice.model_extra or {})["stop_reason"] == stop
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:start]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_goes_through_the_template(server: Server, offline: LLM) -> None:
    """Chat renders the template (LLM.chat's prompt tokens) and answers alike, streamed too."""
    messages = [{"role": "user", "content": "Pass the baton"}]
    expected = offline.chat(messages, _greedy(10))[0]
    client = server.client()
    resp = client.chat.completions.create(
        model=NAME,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert (resp.model_extra or {})["prompt_token_ids"] == expected.prompt_token_ids
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    _assert_same_greedy((choice.model_extra or {})["token_ids"], expected)
    assert resp.usage is not None and resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(
        model=NAME,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_an_ask_past_the_room_left_is_cut_to_it(server: Server) -> None:
    """As vLLM: max_tokens (or max_completion_tokens) past what the prompt leaves of the
    context generates up to the context's end and stops with "length"."""
    prompt = [5] * (MAX_MODEL_LEN - 6)
    done = server.client().completions.create(
        model=NAME, prompt=prompt, max_tokens=MAX_MODEL_LEN, extra_body={"ignore_eos": True}
    )
    assert done.usage is not None and done.usage.completion_tokens == 6
    assert done.choices[0].finish_reason == "length"
    chat = server.client().chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi " * 400}],
        max_completion_tokens=MAX_MODEL_LEN,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == MAX_MODEL_LEN
    assert chat.choices[0].finish_reason == "length"


# ---- errors --------------------------------------------------------------------------------


def test_error_statuses_and_shapes(server: Server) -> None:
    """404 unknown model, 400 bad field / over-long prompt (naming limit and length), 413 body."""
    url = f"{server.url}/v1/completions"
    err = expect_error(httpx.post(url, json={"model": "gpt-9", "prompt": "x"}), 404)
    assert err["type"] == "NotFoundError" and "gpt-9" in err["message"]
    err = expect_error(httpx.post(url, json={"prompt": "x", "temperature": -1}), 400)
    assert err["param"] == "temperature"
    err = expect_error(httpx.post(url, json={"prompt": "x", "n": "many"}), 400)
    assert err["param"] == "n"
    err = expect_error(httpx.post(url, json={"prompt": [5] * 1100}), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and "1100" in err["message"]
    err = expect_error(httpx.post(url, json={"prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}), 400)
    assert err["param"] == "max_tokens" and str(MAX_MODEL_LEN) in err["message"]
    expect_error(httpx.post(url, json={"prompt": "x" * 200_000}), 413)
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=NAME, prompt="x", top_p=0)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-9", prompt="x")


def test_waiting_bound_gives_429(model: Path, tmp_path: Path) -> None:
    """With --max-waiting-requests 1 and one running slot, a request past the queue gets 429."""
    s = start_server(model, tmp_path, "--max-num-seqs", "1", "--max-waiting-requests", "1")
    try:

        async def go() -> None:
            async with s.async_client() as client:
                streams = [
                    await client.completions.create(
                        model=NAME,
                        prompt=f"long {i}",
                        max_tokens=1000,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(2)
                ]
                deadline = time.monotonic() + 10
                while s.metrics()["vllm:num_requests_waiting{}"] < 1:
                    assert time.monotonic() < deadline, "no request ever waited"
                    await asyncio.sleep(0.05)
                with pytest.raises(openai.RateLimitError):
                    await client.completions.create(model=NAME, prompt="one more", max_tokens=2)
                for stream in streams:
                    await stream.close()

        asyncio.run(go())
    finally:
        s.stop()


# ---- the other routes ----------------------------------------------------------------------


def test_tokenize_detokenize_models_openapi(server: Server, offline: LLM) -> None:
    """/tokenize matches the tokenizer, /detokenize inverts it; /v1/models and the schema serve."""
    tokens = offline.tokenizer.encode("Hello world", add_special_tokens=False)
    r = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}
    ).json()
    assert r["tokens"] == tokens and r["count"] == len(tokens)
    assert r["max_model_len"] == MAX_MODEL_LEN
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()
    assert r == {"prompt": "Hello world"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/metrics"} <= set(schema["paths"])
    assert httpx.get(f"{server.url}/version").json() == {"version": metadata.version("baton")}
    wrong = expect_error(httpx.get(f"{server.url}/v1/completions"), 405)
    assert wrong["type"] == "MethodNotAllowed"


def test_metrics_use_vllm_names(server: Server) -> None:
    """/metrics exposes vLLM's metric names with model_name and engine labels."""
    server.client().completions.create(model=NAME, prompt="count me", max_tokens=3)
    m = server.metrics()
    for name in (
        "vllm:num_requests_running{}",
        "vllm:num_requests_waiting{}",
        "vllm:kv_cache_usage_perc{}",
        "vllm:prefix_cache_queries_total{}",
        "vllm:prefix_cache_hits_total{}",
        "vllm:num_preemptions_total{}",
        "vllm:prompt_tokens_total{}",
        "vllm:generation_tokens_total{}",
        "vllm:time_to_first_token_seconds_count{}",
        "vllm:inter_token_latency_seconds_count{}",
        "vllm:e2e_request_latency_seconds_count{}",
        "vllm:request_queue_time_seconds_count{}",
        "vllm:iteration_tokens_total_count{}",
    ):
        assert name in m, name
    assert m['vllm:request_success_total{finished_reason="length"}'] >= 1
    assert m["vllm:generation_tokens_total{}"] >= 3
