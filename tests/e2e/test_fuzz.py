"""Hostile input against real engine and router processes: schemathesis fuzzing from the OpenAPI
schemas, and hand-written cases (invalid UTF-8, NaN, huge numbers, 10 MB bodies, thousands of
stop strings, slow-loris clients, connection floods). Every answer is below 500 or the
documented 503, within a timeout; every process survives; resident memory stays bounded.

The router's own schema has only its GET routes (its OpenAI routes are plain Starlette routes
that pass bodies through unchecked), so its OpenAI routes are fuzzed with the engine's schema.
The long run (`-m long`) is many more examples of the same, and the connection floods.
"""

from __future__ import annotations

import collections
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.e2e.stacks import READ_TIMEOUT, Stack, disagg_stack, engine_stack, save_figures

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = "128"  # bounds every generation, so a fuzzed request takes at most seconds
CALL_TIMEOUT = 30.0  # a fuzzed request that takes longer is a hang
# Per operation and generation mode: every route is fuzzed both ways, first on a fixed,
# reproducible set of examples, then on many random ones (the search for new failures). Both
# are a search rather than a behaviour, so both run in make test-long (in CI); make test keeps
# the hand-written cases below.
FAST_EXAMPLES = 10
LONG_EXAMPLES = 150
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
ROUTER_SHARED = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@pytest.fixture(scope="module")
def engine(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("fuzz-engine")
    with engine_stack(tiny_model("llama"), tmp, "--max-model-len", MAX_MODEL_LEN) as stack:
        yield stack
        assert not stack.dead(), stack.logs()


@pytest.fixture(scope="module")
def routed(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("fuzz-router")
    with disagg_stack(tiny_model("llama"), tmp, "--max-model-len", MAX_MODEL_LEN) as stack:
        yield stack
        assert not stack.dead(), stack.logs()


@pytest.fixture(params=["engine", "router"])
def target(request: pytest.FixtureRequest) -> Stack:
    """Each hand-written case runs against the engine and through the router."""
    return request.getfixturevalue("engine" if request.param == "engine" else "routed")


# ---- schemathesis --------------------------------------------------------------------------


def _schema(stack: Stack, engine_url: str) -> dict[str, Any]:
    """The OpenAPI schema to fuzz `stack` with: its own, plus the engine's OpenAI routes when
    the stack is a router (whose schema lacks them)."""
    engine_schema = httpx.get(f"{engine_url}/openapi.json", timeout=5).json()
    if stack.router is None:
        return dict(engine_schema)
    own = httpx.get(f"{stack.url}/openapi.json", timeout=5).json()
    merged = dict(engine_schema)
    merged["paths"] = {
        **own["paths"],
        **{p: engine_schema["paths"][p] for p in ROUTER_SHARED},
    }
    return merged


def _warm_up(stack: Stack) -> None:
    for i in range(8):
        r = httpx.post(
            f"{stack.url}/v1/completions",
            json={"prompt": f"warm up {i}", "max_tokens": 8, "stream": i % 2 == 0},
            timeout=CALL_TIMEOUT,
        )
        assert r.status_code == 200, r.text


@dataclass
class _Tally:
    cases: int = 0
    slowest: float = 0.0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)


def _fuzz_operation(
    stack: Stack,
    session: requests.Session,
    operation: schemathesis.APIOperation,
    mode: GenerationMode,
    settings_: settings,
    tally: _Tally,
) -> None:
    label = operation.label

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings_
    def run(case: schemathesis.Case) -> None:
        tally.cases += 1
        started = time.monotonic()
        try:
            response = case.call(base_url=stack.url, session=session, timeout=CALL_TIMEOUT)
        except requests.RequestException as e:
            tally.failures.append(f"{label}: {type(e).__name__}: {e}\n  {case.body!r}")
            return
        tally.slowest = max(tally.slowest, time.monotonic() - started)
        status = response.status_code
        tally.statuses[f"{status // 100}xx" if status != 503 else "503"] += 1
        if status >= 500 and status != 503:
            body = repr(case.body)[:300]
            tally.failures.append(f"{label}: {status} {response.text[:300]}\n  {body}")

    with contextlib.suppress(Unsatisfiable):  # a GET without parameters has no invalid form
        run()


def fuzz(stack: Stack, engine_url: str, max_examples: int, derandomize: bool) -> dict[str, Any]:
    """Runs schemathesis over every operation in both generation modes; returns the figures
    and the failures (5xx other than 503, a hang, a dead process)."""
    schema = schemathesis.openapi.from_dict(_schema(stack, engine_url))
    session = requests.Session()
    tally = _Tally()
    settings_ = settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in MODES:
            _fuzz_operation(stack, session, operation, mode, settings_, tally)
            dead = stack.dead()
            if dead:
                tally.failures.append(f"{operation.label} ({mode.value}): {dead} died")
                break
    return {
        "cases": tally.cases,
        "statuses": dict(tally.statuses),
        "failures": tally.failures,
        "slowest_s": round(tally.slowest, 2),
    }


def _fuzz_and_check(stack: Stack, engine_url: str, examples: int, derandomize: bool) -> None:
    _warm_up(stack)
    before = stack.rss()
    started = time.monotonic()
    figures = fuzz(stack, engine_url, examples, derandomize)
    after = stack.rss()
    figures["seconds"] = round(time.monotonic() - started, 1)
    figures["rss_mb"] = {n: (before[n] >> 20, after[n] >> 20) for n in before}
    print(f"\nfuzz {'router' if stack.router else 'engine'}: {json.dumps(figures, default=str)}")
    save_figures(f"fuzz-{'router' if stack.router else 'engine'}-{examples}", figures)
    assert not figures["failures"], "\n".join(figures["failures"][:20]) + "\n" + stack.logs()
    assert not stack.dead(), stack.logs()
    for name, value in after.items():  # fuzzing allocates and frees; it must not accumulate
        assert value <= before[name] * 1.25 + (32 << 20), (name, before[name], value)


@pytest.mark.long
def test_fuzz_engine(engine: Stack) -> None:
    """The engine's API, fuzzed from its schema: no 5xx but 503, no hang, no crash, no growth."""
    _fuzz_and_check(engine, engine.url, FAST_EXAMPLES, derandomize=True)


@pytest.mark.long
def test_fuzz_router(routed: Stack) -> None:
    """The router (over prefill + decode), fuzzed from its and the engine's schemas."""
    _fuzz_and_check(routed, routed.engines["decode"].url, FAST_EXAMPLES, derandomize=True)


@pytest.mark.long
def test_fuzz_engine_long(engine: Stack) -> None:
    """As test_fuzz_engine, with many more random examples."""
    _fuzz_and_check(engine, engine.url, LONG_EXAMPLES, derandomize=False)


@pytest.mark.long
def test_fuzz_router_long(routed: Stack) -> None:
    """As test_fuzz_router, with many more random examples."""
    _fuzz_and_check(routed, routed.engines["decode"].url, LONG_EXAMPLES, derandomize=False)


# ---- hand-written cases --------------------------------------------------------------------


def _post(stack: Stack, body: bytes | str, route: str = "/v1/completions") -> httpx.Response:
    content = body.encode() if isinstance(body, str) else body
    return httpx.post(
        stack.url + route,
        content=content,
        headers={"content-type": "application/json"},
        timeout=CALL_TIMEOUT,
    )


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert body["object"] == "error" and body["error"]["code"] == status, body
    return dict(body["error"])


def test_invalid_utf8(target: Stack) -> None:
    """A body that is not UTF-8 is a 400, not a 500."""
    _error(_post(target, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}'), 400)
    _error(_post(target, b"\xc3\x28", "/tokenize"), 400)


@pytest.mark.parametrize(
    "body",
    [
        '{"prompt": "hi", "temperature": NaN}',
        '{"prompt": "hi", "top_p": Infinity}',
        '{"prompt": "hi", "temperature": -Infinity}',
        '{"prompt": "hi", "temperature": -1.5}',
        '{"prompt": "hi", "top_p": -0.1}',
        '{"prompt": "hi", "presence_penalty": 1e400}',
        '{"prompt": "hi", "max_tokens": -3}',
        '{"prompt": "hi", "max_tokens": 100000000000000000000000}',
        '{"prompt": "hi", "max_tokens": 1000000}',
        '{"prompt": "hi", "n": 0}',
    ],
)
def test_bad_numbers(target: Stack, body: str) -> None:
    """NaN and infinities (as raw JSON), negative and huge numbers: 400 naming the field."""
    _error(_post(target, body), 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # an id past the vocabulary was decoded for `echo` before it was checked: 500
        ('{"prompt": [100000000000000000000], "echo": true, "max_tokens": 2}', "prompt"),
        # integers past 64 bits passed validation, then failed to encode for the core: 500
        ('{"prompt": "hi", "top_k": 100000000000000000000, "max_tokens": 2}', "top_k"),
        ('{"prompt": "hi", "priority": -100000000000000000000, "max_tokens": 2}', "priority"),
        ('{"prompt": "hi", "stop_token_ids": [100000000000000000000]}', "stop_token_ids"),
        # n had no bound: n=100000 kept the engine busy for minutes (OpenAI's bound is 128)
        ('{"prompt": "hi", "n": 129, "max_tokens": 2}', "n"),
    ],
)
def test_out_of_range_integers(target: Stack, body: str, param: str) -> None:
    """Integers the engine cannot carry or afford are a 400 naming the field (each was a 500
    or a minutes-long request before)."""
    assert _error(_post(target, body), 400)["param"] == param


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_kv_transfer_params_past_64_bits(engine: Stack, route: str) -> None:
    """An integer past 64 bits anywhere in kv_transfer_params once failed to encode on its way to
    the EngineCore, a 500 (found by schemathesis). Now a 400, even in a key Baton ignores. (The
    router replaces a client's kv_transfer_params with its own hand-off, so only the engine is
    asked.)"""
    prompt = (
        '"prompt": "hi"'
        if route == "/v1/completions"
        else '"messages": [{"role": "user", "content": "hi"}]'
    )
    body = f'{{{prompt}, "max_tokens": 2, "kv_transfer_params": {{"x": [100000000000000000000]}}}}'
    assert _error(_post(engine, body, route), 400)["param"] == "kv_transfer_params"


@pytest.mark.parametrize(
    "body",
    [
        '{"prompt": 5}',
        '{"prompt": "hi", "max_tokens": "many"}',
        '{"prompt": "hi", "stop": {"a": 1}}',
        '{"prompt": "hi", "stream_options": []}',
        '{"messages": "hi"}',
        "[1, 2, 3]",
        '"just a string"',
        "{",
        "",
    ],
)
def test_wrong_types(target: Stack, body: str) -> None:
    """Wrong JSON types, truncated or empty bodies: 400."""
    _error(_post(target, body), 400)


def test_unknown_fields_are_ignored(target: Stack) -> None:
    """Fields the server does not know are ignored, as OpenAI clients add new ones often."""
    body = {"prompt": "hi", "max_tokens": 2, "frobnicate": {"x": [1, 2]}, "tempreature": 3}
    r = _post(target, json.dumps(body))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_thousands_of_stop_strings(target: Stack) -> None:
    """5,000 stop strings: a 400 naming `stop` (at most 4, OpenAI's and vLLM's bound), at once;
    four long ones are served."""
    stops = [f"stop string number {i}" for i in range(5000)]
    started = time.monotonic()
    r = _post(target, json.dumps({"prompt": "hi", "max_tokens": 32, "stop": stops}))
    assert _error(r, 400)["param"] == "stop"
    assert time.monotonic() - started < 10
    long = ["x" * 10_000 + str(i) for i in range(4)]
    r = _post(target, json.dumps({"prompt": "hi", "max_tokens": 32, "stop": long}))
    assert r.status_code == 200, r.text


def test_ten_megabyte_bodies(target: Stack) -> None:
    """Bodies past 10 MiB get 413, whether the size is announced or only streamed."""
    big = json.dumps({"prompt": "a" * (10 << 20), "max_tokens": 2}).encode()
    _error(_post(target, big), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    r = httpx.post(
        target.url + "/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=CALL_TIMEOUT,
    )
    _error(r, 413)


def test_announced_huge_body_is_refused_before_it_arrives(target: Stack) -> None:
    """A Content-Length of 1 GB is refused at once, without waiting for (or buffering) the
    body. The router used to read every body whole first: it hung here, then held it all."""
    with socket.create_connection(("127.0.0.1", _port(target)), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000000000\r\n\r\n{"prompt": "'
        )
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def _port(stack: Stack) -> int:
    return int(stack.url.rsplit(":", 1)[1])


def _closed_within(s: socket.socket, timeout: float) -> float | None:
    """Seconds until the server closes `s` (reading what it sends), None if still open."""
    started = time.monotonic()
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


# The engine and the router share the read deadline (baton.http_server): every stall against
# the engine, and against the router the one a proxy could get wrong (a body it passes on); its
# other two stalls, 2 s of waiting each, run in make test-long.
_LORIS_CASES = [
    pytest.param("engine", "headers", id="engine-headers"),
    pytest.param("engine", "body", id="engine-body"),
    pytest.param("engine", "nothing", id="engine-nothing"),
    pytest.param("router", "body", id="router-body"),
    pytest.param("router", "headers", id="router-headers", marks=pytest.mark.long),
    pytest.param("router", "nothing", id="router-nothing", marks=pytest.mark.long),
]


@pytest.mark.parametrize(("target", "stall"), _LORIS_CASES, indirect=["target"])
def test_slow_loris(target: Stack, stall: str) -> None:
    """A client that sends its request a byte at a time and stalls (in its headers, in its
    body, or before its first byte) does not keep others from being served, and is dropped
    after --request-read-timeout. uvicorn only timed out idle keep-alive connections: these
    sockets stayed open forever."""
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 40\r\n\r\n{"prompt": "hi",'
    )
    cut = {"headers": 30, "body": len(request), "nothing": 0}[stall]
    lorises = [socket.create_connection(("127.0.0.1", _port(target))) for _ in range(20)]
    try:
        # The start in one piece, the last bytes one at a time (a whole byte-by-byte drip on a
        # loaded machine could outlast the read timeout itself).
        drip = max(cut - 10, 0)
        for s in lorises:
            s.sendall(request[:drip])
        for i in range(drip, cut):
            for s in lorises:
                s.send(request[i : i + 1])
            time.sleep(0.005)
        r = _post(target, '{"prompt": "meanwhile", "max_tokens": 4}')
        assert r.status_code == 200, r.text
        with ThreadPoolExecutor(len(lorises)) as pool:
            waits = list(pool.map(lambda s: _closed_within(s, READ_TIMEOUT + 5), lorises))
        assert all(w is not None for w in waits), waits
    finally:
        for s in lorises:
            s.close()
    assert not target.dead()


@pytest.mark.long  # load: hundreds of sockets and requests at once
def test_connection_flood(target: Stack) -> None:
    """500 idle connections and 200 concurrent requests at once: every request is answered
    (200, or 503/429 under pressure), the idle sockets are dropped, the server lives."""
    idle = [socket.create_connection(("127.0.0.1", _port(target))) for _ in range(500)]
    try:

        def one(i: int) -> int:
            with httpx.Client(timeout=CALL_TIMEOUT) as client:
                if i % 4:
                    return client.get(f"{target.url}/v1/models").status_code
                body = {"prompt": f"flood {i}", "max_tokens": 2}
                return client.post(f"{target.url}/v1/completions", json=body).status_code

        with ThreadPoolExecutor(64) as pool:
            codes = collections.Counter(pool.map(one, range(200)))
        assert set(codes) <= {200, 429, 503}, codes
        assert codes[200] >= 150, codes
        with ThreadPoolExecutor(50) as pool:
            waits = list(pool.map(lambda s: _closed_within(s, READ_TIMEOUT + 10), idle))
        assert all(w is not None for w in waits)
    finally:
        for s in idle:
            s.close()
    assert not target.dead()
    r = _post(target, '{"prompt": "after the flood", "max_tokens": 2}')
    assert r.status_code == 200, r.text
