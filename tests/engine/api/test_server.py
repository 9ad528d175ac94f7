"""End to end: the real engine server in a subprocess (API server + EngineCore processes), driven
by the official `openai` client and plain HTTP, compared with the offline `LLM`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from baton import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[3]
MAX_MODEL_LEN = 1024
NAME = "tiny"
PROMPTS = ["The relay team passed the baton", "Paged attention stores", "Hello"]
NEAR_TIE = 1e-4  # logprob gap under which a different batch may legitimately pick either token

pytestmark = pytest.mark.slow  # every test here needs a server process: seconds to start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    """Child process ids of `pid`, from /proc (the EngineCore is one)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry.name))
    return kids


def _engine_core_pid(server_pid: int) -> int:
    for pid in _children(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:  # not multiprocessing's resource tracker
            return pid
    raise AssertionError(f"no EngineCore child of {server_pid}")


class Server:
    """`python -m baton.engine.api.server` on a free port; its output goes to a log file."""

    def __init__(self, model: Path, log: Path, *flags: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        cmd = [
            sys.executable, "-m", "baton.engine.api.server",
            "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", NAME,
            "--disable-uvicorn-access-log", "--log-level", "WARNING", *flags,
        ]  # fmt: skip
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail(f"server not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        """SIGTERM (drain), then SIGKILL for the server and its children if it lingers."""
        if self.proc.poll() is None:
            kids = _children(self.proc.pid)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            for pid in kids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def metrics(self) -> dict[str, float]:
        """`name{other labels}` → value; the model_name and engine labels are checked, then
        left out of the key."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        values = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            pairs = [x for x in labels.rstrip("}").split(",") if x]
            assert 'model_name="tiny"' in pairs and 'engine="0"' in pairs, line
            rest = [x for x in pairs if x not in ('model_name="tiny"', 'engine="0"')]
            values[f"{name}{{{','.join(rest)}}}"] = float(value)
        return values


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> Path:
    return Path(tiny_model("llama"))


def _start(model: Path, tmp: Path, *flags: str) -> Server:
    server = Server(model, tmp / f"server-{time.monotonic_ns()}.log", *flags)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = _start(model, tmp_path_factory.mktemp("server"), "--max-body-bytes", "100000")
    try:
        yield s
    finally:
        s.stop()


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


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error" and body["error"]["code"] == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


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
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


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


# ---- errors --------------------------------------------------------------------------------


def test_error_statuses_and_shapes(server: Server) -> None:
    """404 unknown model, 400 bad field / over-long prompt (naming limit and length), 413 body."""
    url = f"{server.url}/v1/completions"
    err = _error(httpx.post(url, json={"model": "gpt-9", "prompt": "x"}), 404)
    assert err["type"] == "NotFoundError" and "gpt-9" in err["message"]
    err = _error(httpx.post(url, json={"prompt": "x", "temperature": -1}), 400)
    assert err["param"] == "temperature"
    err = _error(httpx.post(url, json={"prompt": "x", "n": "many"}), 400)
    assert err["param"] == "n"
    err = _error(httpx.post(url, json={"prompt": [5] * 1100}), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and "1100" in err["message"]
    _error(httpx.post(url, json={"prompt": "x" * 200_000}), 413)
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=NAME, prompt="x", top_p=0)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-9", prompt="x")


def test_waiting_bound_gives_429(model: Path, tmp_path: Path) -> None:
    """With --max-waiting-requests 1 and one running slot, a request past the queue gets 429."""
    s = _start(model, tmp_path, "--max-num-seqs", "1", "--max-waiting-requests", "1")
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


# ---- load, aborts, shutdown, death ---------------------------------------------------------


def _wait_idle(server: Server, seconds: float) -> dict[str, float]:
    deadline = time.monotonic() + seconds
    while True:
        m = server.metrics()
        idle = m["vllm:num_requests_running{}"] == 0 and m["vllm:num_requests_waiting{}"] == 0
        if idle and m["vllm:kv_cache_usage_perc{}"] == 0:
            return m
        assert time.monotonic() < deadline, f"not idle after {seconds} s: {m}"
        time.sleep(0.05)


def test_client_gone_aborts_a_non_streaming_request(server: Server) -> None:
    """A non-streaming client that disconnects (times out) gets its request aborted."""
    aborts = 'vllm:request_success_total{finished_reason="abort"}'
    before = server.metrics()[aborts]

    async def go() -> None:
        async with httpx.AsyncClient(timeout=0.3) as client:

            async def one(i: int) -> None:
                body = {"prompt": f"impatient {i}", "max_tokens": 1000, "ignore_eos": True}
                with pytest.raises(httpx.TimeoutException):
                    await client.post(f"{server.url}/v1/completions", json=body)

            await asyncio.gather(*(one(i) for i in range(8)))

    asyncio.run(go())
    # Left running, the 8 would take over a second more: idle sooner means aborted.
    m = _wait_idle(server, 0.5)
    assert m[aborts] - before == 8


def test_200_streams_complete_and_50_aborts_free_the_cache(server: Server) -> None:
    """200 concurrent streams all finish; 50 more closed mid-stream are aborted in the engine,
    leaving nothing running and the KV cache back at idle."""
    aborted_before = server.metrics().get('vllm:request_success_total{finished_reason="abort"}', 0)

    async def go() -> tuple[list[str | None], int]:
        async with server.async_client() as client:

            async def full(i: int) -> str | None:
                stream = await client.completions.create(
                    model=NAME, prompt=f"stream {i}", max_tokens=6, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                finish = None
                async for chunk in stream:
                    finish = chunk.choices[0].finish_reason or finish
                return finish

            async def abort(i: int) -> int:
                stream = await client.completions.create(
                    model=NAME, prompt=f"abort {i}", max_tokens=1000, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                async for _ in stream:
                    break
                await stream.close()
                return 1

            results = await asyncio.gather(
                *(full(i) for i in range(200)), *(abort(i) for i in range(50))
            )
        return [r for r in results[:200] if not isinstance(r, int)], sum(results[200:])  # type: ignore[arg-type]

    finishes, num_aborted = asyncio.run(go())
    assert finishes == ["length"] * 200 and num_aborted == 50
    # Left running, the 50 would take ~10 s more on two CPU cores: idle sooner means aborted.
    m = _wait_idle(server, 3)
    aborted = m['vllm:request_success_total{finished_reason="abort"}'] - aborted_before
    assert aborted == 50


def test_sigterm_drains_in_flight_then_exits_zero(model: Path, tmp_path: Path) -> None:
    """After SIGTERM new requests get 503 while in-flight streams finish; then exit code 0."""
    s = _start(model, tmp_path, "--shutdown-timeout", "30")
    try:
        client = s.client()
        stream = client.completions.create(
            model=NAME, prompt="drain me", max_tokens=1000, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        first = next(chunks)
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2
        while httpx.get(f"{s.url}/health").status_code != 503:
            assert time.monotonic() < deadline, "still healthy after SIGTERM"
            time.sleep(0.01)
        _error(httpx.post(f"{s.url}/v1/completions", json={"prompt": "late"}), 503)
        rest = list(chunks)
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
        assert rest[-1].choices[0].finish_reason == "length" and text
        assert s.proc.wait(20) == 0
    finally:
        s.stop()


def test_engine_core_death_fails_open_requests_and_exits_nonzero(
    model: Path, tmp_path: Path
) -> None:
    """Killing the EngineCore mid-stream ends every open stream with an error within seconds,
    and the server process exits non-zero."""
    s = _start(model, tmp_path)
    try:

        async def go() -> list[BaseException | None]:
            async with s.async_client() as client:
                streams = [
                    await client.completions.create(
                        model=NAME,
                        prompt=f"doomed {i}",
                        max_tokens=1000,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(3)
                ]
                iterators = [aiter(st) for st in streams]
                for it in iterators:
                    await anext(it)
                os.kill(_engine_core_pid(s.proc.pid), signal.SIGKILL)

                async def drain(it: Any) -> BaseException | None:
                    try:
                        async for _ in it:
                            pass
                    except openai.APIError as e:
                        return e
                    return None

                return await asyncio.wait_for(
                    asyncio.gather(*(drain(it) for it in iterators)), timeout=5
                )

        errors = asyncio.run(go())
        assert all(isinstance(e, openai.APIError) for e in errors), errors
        assert all("engine" in str(e) for e in errors), errors
        assert s.proc.wait(10) != 0
    finally:
        s.stop()
