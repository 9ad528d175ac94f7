"""The OpenAI wire format without an engine: request → SamplingParams and errors (response shapes
are in test_responses), and the app's routes over a scripted fake engine (a character tokenizer
and the real `OutputProcessor`, so detokenization and stop strings behave as in the server)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from baton.engine.api import protocol as p
from baton.engine.api.server import ServerConfig, build_app
from baton.engine.config import EngineArgs
from baton.engine.output_processor import OutputProcessor
from baton.engine.outputs import RequestOutput
from baton.engine.processor import check_prompt_token_ids, child_requests
from baton.engine.protocol import EngineCoreOutput, EngineStats, LogprobsEntry
from baton.engine.sampling_params import SamplingParams
from baton.errors import APIError
from baton.kv_transfer.fingerprint import Fingerprint
from baton.tokenizer import Tokenizer

SCRIPT = "hello world, the baton passes on. "  # what the fake model writes, over and over

# ---- request → SamplingParams --------------------------------------------------------------


def test_completion_request_defaults_follow_vllm() -> None:
    """Fields a request leaves out take vLLM's defaults; stop and top_k=-1 are normalised."""
    req = p.CompletionRequest(prompt="hi", stop="x", top_k=-1)
    params = req.to_sampling_params(16)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
    assert params.repetition_penalty == 1.0
    assert params.stop == ["x"] and params.max_tokens == 16 and params.logprobs is None


def test_request_extras_reach_sampling_params() -> None:
    """vLLM's extra sampling fields are passed through unchanged."""
    req = p.CompletionRequest(
        prompt=[1, 2],
        temperature=0.5,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[7],
        seed=3,
        n=2,
        logprobs=2,
    )
    params = req.to_sampling_params(8)
    assert params.temperature == 0.5 and params.top_k == 5 and params.min_p == 0.1
    assert params.repetition_penalty == 1.2 and params.min_tokens == 2 and params.ignore_eos
    assert params.stop_token_ids == [7] and params.seed == 3 and params.n == 2
    assert params.logprobs == 2


def test_at_most_four_stop_strings() -> None:
    """OpenAI's and vLLM's bound on `stop`: a fifth string is a validation error (a 400)."""
    assert p.CompletionRequest(prompt="hi", stop=["a", "b", "c", "d"]).stop == ["a", "b", "c", "d"]
    with pytest.raises(ValidationError):
        p.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stop=list("abcde"))


def test_several_greedy_answers_are_vllms_400() -> None:
    """n > 1 at temperature 0 would be n copies of one answer: vLLM refuses it, in these words."""
    with pytest.raises(APIError) as e:
        p.CompletionRequest(prompt=[1, 2], temperature=0, n=2).to_sampling_params(8)
    assert e.value.status == 400 and e.value.param == "n"
    assert e.value.message == "n must be 1 when using greedy sampling, got 2."
    assert p.CompletionRequest(prompt=[1], temperature=0, n=1).to_sampling_params(8).greedy


def test_chat_logprobs_map_to_top_logprobs() -> None:
    """Chat's `logprobs: true` + `top_logprobs: k` asks the engine for k alternatives."""

    def chat(**kw: Any) -> p.ChatCompletionRequest:
        return p.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw)

    assert chat(logprobs=True, top_logprobs=3).to_sampling_params(4).logprobs == 3
    assert chat(logprobs=True).to_sampling_params(4).logprobs == 0
    assert chat().to_sampling_params(4).logprobs is None
    with pytest.raises(APIError) as e:
        chat(top_logprobs=2).check()
    assert e.value.param == "top_logprobs"
    with pytest.raises(APIError) as e:
        chat(logprobs=True, top_logprobs=50).to_sampling_params(4)
    assert e.value.status == 400 and e.value.param == "top_logprobs"


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("n", 0), ("logprobs", 30), ("min_p", 2.0)],
)
def test_out_of_range_fields_are_400_naming_the_field(field: str, value: object) -> None:
    """SamplingParams' range errors become 400s whose param is the offending field."""
    req = p.CompletionRequest(prompt="x", **{field: value})
    with pytest.raises(APIError) as e:
        req.to_sampling_params(4)
    assert e.value.status == 400 and e.value.param == field and field in e.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [({"suffix": "x"}, "suffix"), ({"stream_options": {"include_usage": True}}, "stream_options")],
)
def test_unsupported_fields_are_rejected(body: dict[str, Any], param: str) -> None:
    """What the server cannot honour is a 400 naming the field, never silently ignored."""
    with pytest.raises(APIError) as e:
        p.CompletionRequest(prompt="x", **body).check()
    assert e.value.status == 400 and e.value.param == param


def test_prompt_shapes_become_a_batch() -> None:
    """A str, a list of str, a list of ids and a list of id lists are all batches of prompts."""
    assert p.CompletionRequest(prompt="a").prompts() == ["a"]
    assert p.CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert p.CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert p.CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    for empty in ("", [], [[]]):
        with pytest.raises(APIError):
            p.CompletionRequest(prompt=empty).prompts()


def test_max_tokens_resolution() -> None:
    """Unset max_tokens fills the context (or the default); an ask past the room the prompt
    leaves is cut to it (vLLM 0.32's `get_max_tokens`); a prompt that leaves no room, or an ask
    past the whole context, is a 400 naming the limit."""
    assert p.resolve_max_tokens(None, None, 10, 100, "messages") == 90
    assert p.resolve_max_tokens(None, 16, 95, 100, "prompt") == 5
    assert p.resolve_max_tokens(7, 16, 10, 100, "prompt") == 7
    assert p.resolve_max_tokens(95, 16, 10, 100, "prompt") == 90
    assert p.resolve_max_tokens(100, 16, 99, 100, "prompt") == 1
    for prompt_len in (100, 120):
        with pytest.raises(APIError) as e:
            p.resolve_max_tokens(None, 16, prompt_len, 100, "prompt")
        assert "100" in e.value.message and str(prompt_len) in e.value.message
        assert e.value.param == "prompt"
    with pytest.raises(APIError) as e:
        p.resolve_max_tokens(101, 16, 10, 100, "messages", "max_completion_tokens")
    assert e.value.param == "max_completion_tokens" and "101" in e.value.message


def test_error_body_is_openai_shaped() -> None:
    """Errors carry OpenAI's `error` object (message, type, param, code) and vLLM's `object`."""
    body = APIError(404, "no such model", "model").body()
    assert body == {
        "object": "error",
        "error": {
            "message": "no such model",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        },
    }


# ---- the app over a fake engine ------------------------------------------------------------


# What the fake chat template writes: "<role>content" per message, then "<assistant>".
CHAR_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def char_tokenizer() -> Tokenizer:
    """One token per character; token id = code point (a real `Tokenizer`, so detokenization
    streams as in the server)."""
    backend = Backend(models.WordLevel({chr(i): i for i in range(512)}, unk_token=chr(0)))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    backend.decoder = decoders.Fuse()
    return Tokenizer(backend, chat_template=CHAR_CHAT_TEMPLATE)


class FakeLLM:
    """Writes SCRIPT, one character per step, through the real OutputProcessor."""

    def __init__(self) -> None:
        self.tokenizer = char_tokenizer()
        self.vocab_size = 512
        self.eos_token_ids = (2,)
        self.model_path = Path("/models/fake-model")
        self.max_model_len = 64
        self.num_blocks = 16
        self.args = EngineArgs()
        self.kv_transport: str | None = None
        self.kv_ports: list[int] | None = None
        self.fingerprint: Fingerprint | None = None
        self.stats = EngineStats()
        self.dead_error: Exception | None = None
        self.aborted: list[str] = []
        self.seen: list[tuple[str, list[int], SamplingParams]] = []

    def add_stats_listener(self, listener: object) -> None:
        pass

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        kv_transfer_params: dict | None = None,
        resume_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        sink: object = None,  # never offered a snapshot: every one is yielded
    ) -> AsyncIterator[RequestOutput]:
        check_prompt_token_ids(prompt_token_ids, self.max_model_len, 512)
        self.seen.append((request_id, prompt_token_ids, sampling_params))
        processor = OutputProcessor(self.tokenizer)
        children = child_requests(request_id, sampling_params)
        processor.add_request(
            request_id, prompt, prompt_token_ids, [c for c, _ in children], sampling_params
        )
        done: set[str] = set()
        finished = False
        try:
            for step in range(sampling_params.max_tokens or 1):
                outs = []
                for k, (child, params) in enumerate(children):
                    if child in done:
                        continue
                    token = ord(SCRIPT[(step + k) % len(SCRIPT)])
                    last = step + 1 == params.max_tokens
                    entry = None
                    if params.logprobs is not None:
                        ids = [token, *range(token, token + params.logprobs)]
                        entry = [LogprobsEntry(ids, [-0.25] + [-1.0] * params.logprobs, 1)]
                    outs.append(
                        EngineCoreOutput(
                            child, [token], entry, finish_reason="length" if last else None
                        )
                    )
                    if last:
                        done.add(child)
                updates, to_abort = processor.process_outputs(outs)
                done.update(to_abort)
                await asyncio.sleep(0)
                for update in updates:
                    finished = update.finished
                    yield update
                if finished:
                    return
        finally:
            if not finished:
                self.aborted.append(request_id)


def _app(llm: FakeLLM | None = None, **config: Any) -> Any:
    return build_app(llm or FakeLLM(), ServerConfig(**config))  # type: ignore[arg-type]


def _call(app: Any, method: str, url: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, url, **kwargs)

    return asyncio.run(go())


def _events(response: httpx.Response) -> list[Any]:
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.text.split("\n\n")
    assert raw[-1] == "" and raw[-2] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in raw[:-2]]


def _error(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error" and body["error"]["code"] == status
    assert body["error"]["param"] == param
    return str(body["error"]["message"])


def test_validation_errors_are_400_not_422() -> None:
    """A field of the wrong type is a 400 in OpenAI's shape naming the field."""
    app = _app()
    r = _call(app, "POST", "/v1/completions", json={"prompt": "x", "temperature": "hot"})
    assert "temperature" in _error(r, 400, "temperature")
    r = _call(
        app,
        "POST",
        "/v1/completions",
        content=b"{oops",
        headers={"content-type": "application/json"},
    )
    _error(r, 400, None)
    r = _call(app, "POST", "/v1/chat/completions", json={"messages": []})
    _error(r, 400, "messages")


def test_unknown_model_is_404() -> None:
    """A request for a model this server does not serve is a 404."""
    r = _call(_app(), "POST", "/v1/completions", json={"prompt": "x", "model": "gpt-9"})
    assert "gpt-9" in _error(r, 404, "model")


def test_oversized_body_is_413() -> None:
    """A body past max_body_bytes is refused by its Content-Length and by what arrives."""
    app = _app(max_body_bytes=1000)
    r = _call(app, "POST", "/v1/completions", json={"prompt": "x" * 2000})
    _error(r, 413, None)

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    r = _call(app, "POST", "/v1/completions", content=chunked())
    _error(r, 413, None)


def test_waiting_bound_is_429() -> None:
    """Once the engine has max_waiting_requests waiting, new requests get 429."""
    llm = FakeLLM()
    app = _app(llm, max_waiting_requests=2)
    llm.stats = EngineStats(num_waiting=2)
    _error(_call(app, "POST", "/v1/completions", json={"prompt": "x"}), 429, None)
    llm.stats = EngineStats(num_waiting=1)
    assert _call(app, "POST", "/v1/completions", json={"prompt": "x"}).status_code == 200


def test_draining_or_dead_is_503() -> None:
    """While draining, or once the engine died, /health and new requests get 503."""
    llm = FakeLLM()
    app = _app(llm)
    assert _call(app, "GET", "/health").status_code == 200
    app.state.server.draining = True
    _error(_call(app, "GET", "/health"), 503, None)
    _error(_call(app, "POST", "/v1/completions", json={"prompt": "x"}), 503, None)
    app.state.server.draining = False
    llm.dead_error = RuntimeError("core died")
    _error(
        _call(
            app,
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
        ),
        503,
        None,
    )


def test_prompt_over_the_limit_names_limit_and_length() -> None:
    """A prompt longer than max_model_len is a 400 naming the limit and the prompt's length."""
    r = _call(_app(), "POST", "/v1/completions", json={"prompt": "x" * 70})
    message = _error(r, 400, "prompt")
    assert "64" in message and "70" in message


def test_completion_response_shape() -> None:
    """A non-streaming completion: ids, choices per prompt × n, usage, token ids on request."""
    llm = FakeLLM()
    r = _call(
        _app(llm),
        "POST",
        "/v1/completions",
        json={
            "prompt": ["ab", "c"],
            "max_tokens": 5,
            "n": 2,
            "return_token_ids": True,
            "echo": True,
        },
    )
    body = r.json()
    assert (
        r.status_code == 200
        and body["id"].startswith("cmpl-")
        and body["object"] == "text_completion"
    )
    assert body["model"] == "fake-model" and body["kv_transfer_params"] is None
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"] == "ab" + SCRIPT[:5]
    assert body["choices"][1]["text"] == "ab" + SCRIPT[1:6]  # sample 1 of the fake starts later
    assert body["choices"][2]["text"] == "c" + SCRIPT[:5]
    assert body["choices"][2]["prompt_token_ids"] == [99]
    assert body["choices"][0]["token_ids"] == [ord(c) for c in SCRIPT[:5]]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 20,
        "total_tokens": 23,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert [s.max_tokens for _, _, s in llm.seen] == [5, 5]


def test_stop_string_is_cut_and_never_streamed() -> None:
    """A stop string ends the text before it, with finish_reason stop, streamed or not."""
    app = _app()
    body = {"prompt": "x", "max_tokens": 30, "stop": ["baton"]}
    full = _call(app, "POST", "/v1/completions", json=body).json()["choices"][0]
    assert full["text"] == "hello world, the " and full["finish_reason"] == "stop"
    assert full["stop_reason"] == "baton"
    events = _events(_call(app, "POST", "/v1/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == "hello world, the "
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("b" not in e["choices"][0]["text"] for e in events)


def test_completion_stream_shape_with_usage() -> None:
    """Completion chunks are OpenAI's; include_usage adds `usage: null` and a final usage chunk."""
    body = {
        "prompt": "ab",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = _events(_call(_app(), "POST", "/v1/completions", json=body))
    for e in events:
        assert set(e) == {"id", "object", "created", "model", "choices", "usage"}
        assert e["object"] == "text_completion" and e["id"] == events[0]["id"]
    assert events[0]["choices"] == [
        {"index": 0, "text": "h", "logprobs": None, "finish_reason": None, "stop_reason": None}
    ]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert all(e["usage"] is None for e in events[:-1])


def test_chat_stream_shape() -> None:
    """Chat chunks: a role chunk first, content deltas, finish_reason last, then [DONE]."""
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 3,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 1,
    }
    llm = FakeLLM()
    events = _events(_call(_app(llm), "POST", "/v1/chat/completions", json=body))
    assert llm.seen[0][1] == [ord(c) for c in "<user>hi<assistant>"]
    first = events[0]
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert "usage" not in first
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == SCRIPT[:3]
    assert events[1]["choices"][0]["logprobs"]["content"][0]["token"] == "h"
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_the_models_generation_config_sets_the_defaults(tmp_path: Path) -> None:
    """As vLLM: a field the request leaves out takes the model's generation_config.json value
    (a chat's max_tokens its max_new_tokens); what the request sets wins; `--generation-config
    vllm` keeps vLLM's neutral defaults."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3})
    )
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for source, want in (
        ("auto", (0.0, 0.9, 20, 3)),
        ("vllm", (1.0, 1.0, 0, 64 - len("<user>hi<assistant>"))),
    ):
        llm = FakeLLM()
        llm.model_path = tmp_path
        app = _app(llm, generation_config=source)
        assert _call(app, "POST", "/v1/chat/completions", json=chat).status_code == 200
        asked = {**chat, "temperature": 0.5, "max_tokens": 2}
        assert _call(app, "POST", "/v1/chat/completions", json=asked).status_code == 200
        left, set_ = llm.seen[0][2], llm.seen[1][2]
        assert (left.temperature, left.top_p, left.top_k, left.max_tokens) == want, source
        assert (set_.temperature, set_.top_p, set_.max_tokens) == (0.5, want[1], 2)


def test_chat_response_shape() -> None:
    """A non-streaming chat completion carries an assistant message and usage."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}
    r = _call(_app(), "POST", "/v1/chat/completions", json=body)
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["choices"][0]["message"] == {"role": "assistant", "content": SCRIPT[:4]}
    assert out["choices"][0]["finish_reason"] == "length"
    prompt_len = len("<user>hi<assistant>")
    assert out["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 4,
        "total_tokens": prompt_len + 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_tokenize_and_detokenize() -> None:
    """/tokenize and /detokenize use vLLM's shapes and round-trip."""
    app = _app()
    r = _call(app, "POST", "/tokenize", json={"prompt": "hey", "return_token_strs": True})
    assert r.json() == {
        "count": 3,
        "max_model_len": 64,
        "tokens": [104, 101, 121],
        "token_strs": ["h", "e", "y"],
    }
    assert _call(app, "POST", "/detokenize", json={"tokens": [104, 101, 121]}).json() == {
        "prompt": "hey"
    }
    chat = _call(
        app, "POST", "/tokenize", json={"messages": [{"role": "user", "content": "a"}]}
    ).json()
    assert chat["count"] == len("<user>a<assistant>")
    _error(_call(app, "POST", "/detokenize", json={"tokens": [10**6]}), 400, "tokens")


def test_models_metrics_and_openapi() -> None:
    """/v1/models lists the served name; /metrics uses vLLM's names; the schema is served."""
    app = _app(served_model_name="baton-test")
    models = _call(app, "GET", "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "baton-test"
    _call(
        app, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "model": "baton-test"}
    )
    text = _call(app, "GET", "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prompt_tokens_total",
        'vllm:request_success_total{engine="0",finished_reason="length",'
        'model_name="baton-test"} 1.0',
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in text
    schema = _call(app, "GET", "/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"] and "/tokenize" in schema["paths"]
