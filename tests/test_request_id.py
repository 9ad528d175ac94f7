"""One request id and one trace across `baton serve`'s router, prefill engine and decode engine:
the id in the answer's header and in each process's JSON log lines, the spans at an OTLP
collector stub with one trace id and the right parents; and the id rules themselves."""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from baton.kv_transfer.leases import LeaseTable
from baton.logs import REQUEST_ID
from baton.tracing import RequestTracing, Tracer, current, valid_request_id
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The relay team passes the baton in a marked zone, and the next runner"
MINTED = re.compile(r"[0-9a-f]{32}")
_LINE = re.compile(r"^\[([\w-]+)\] (\{.*\})$")


# ---- the id rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        ("abc-123", True),
        ("tenant:req.7_x-y", True),
        ("a" * 128, True),
        ("a" * 129, False),
        ("", False),
        ("two words", False),
        ("line\nbreak", False),
        ('{"json":1}', False),
        ("é", False),
    ],
)
def test_only_plain_short_ids_are_kept(sent: str, kept: bool) -> None:
    """An id is kept only when it is 1-128 characters of [A-Za-z0-9._:-]."""
    assert (valid_request_id(sent) == sent) is kept


def _echo_app(forward_id: bool) -> Starlette:
    """What an app behind the middleware sees: the id header, REQUEST_ID and its trace."""

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "header": request.headers.get("x-request-id"),
                "logs": REQUEST_ID.get(),
                "trace": current().request_id,
            }
        )

    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"])])
    app.add_middleware(RequestTracing, tracer=Tracer(None, "test", "test"), forward_id=forward_id)
    return app


@pytest.mark.parametrize("forward_id", [True, False])
def test_the_middleware_keeps_replaces_or_mints(forward_id: bool) -> None:
    """A valid client id is used as it is; an invalid one is replaced by a new one everywhere
    (the app's headers too); a missing one is minted, and reaches the app's headers only when
    the app forwards it (the router)."""
    with TestClient(_echo_app(forward_id)) as client:
        r = client.post("/v1/completions", headers={"x-request-id": "client-1"})
        assert r.headers["x-request-id"] == "client-1"
        assert r.json() == {"header": "client-1", "logs": "client-1", "trace": "client-1"}

        r = client.post("/v1/completions", headers={"x-request-id": "x" * 200})
        new = r.headers["x-request-id"]
        assert MINTED.fullmatch(new)
        assert r.json() == {"header": new, "logs": new, "trace": new}

        r = client.post("/v1/completions")
        new = r.headers["x-request-id"]
        assert MINTED.fullmatch(new)
        assert r.json() == {"header": new if forward_id else None, "logs": new, "trace": new}


def test_no_endpoint_imports_no_opentelemetry() -> None:
    """Without --otlp-traces-endpoint, `baton.tracing` imports nothing of OpenTelemetry, and a
    router serving a request through the middleware, with the engine server's module loaded,
    nothing of its SDK or exporter (FastAPI itself imports the API, which does nothing)."""
    code = """
import sys
import baton.tracing
assert not [m for m in sys.modules if m.startswith("opentelemetry")]
from starlette.testclient import TestClient
import baton.engine.api.server
from baton.router.app import build_app
from baton.router.config import RouterConfig
from baton.router.router import Router

traced = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
with TestClient(build_app(Router(RouterConfig()))) as client:
    r = client.post("/v1/completions", json={"prompt": "x"}, headers=traced)
    assert r.status_code == 400 and r.headers["x-request-id"], (r.status_code, r.headers)
loaded = [m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]
print(sorted(loaded))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_leases_log_lines_name_the_client_request() -> None:
    """A prefill engine's lease keeps the client's request id: the lines about serving and
    claiming it carry it as their request id (the lease's name stays the engine's)."""
    table = LeaseTable(torch.zeros(4, 2, 8), "engine-a")
    seen: list[tuple[str, str | None]] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.getMessage(), REQUEST_ID.get()))

    log = logging.getLogger("baton.kv_transfer.leases")
    handler, level = Record(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        table.lease("cmpl-engine-1", [0, 1], time.time() + 30, "client-7")
        table.lookup("engine-a", "cmpl-engine-1", [0, 1], table.block_bytes, 5.0)
        table.end_read("cmpl-engine-1")
        table.claim("engine-a", "cmpl-engine-1")
        table.lease("cmpl-engine-2", [2], time.time() - 1, "client-8")
        table.expire(time.time())
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        table.stop()
    assert [(m.split(":")[0].split(" (")[0], rid) for m, rid in seen] == [
        ("KV lease cmpl-engine-1", "client-7"),
        ("serving KV lease cmpl-engine-1", "client-7"),
        ("KV lease cmpl-engine-1 claimed", "client-7"),
        ("KV lease cmpl-engine-2", "client-8"),
        ("KV lease cmpl-engine-2 expired", "client-8"),
    ]
    assert REQUEST_ID.get() is None


# ---- a collector and `baton serve` ----------------------------------------------------------


class Collector:
    """An OTLP/HTTP collector stub on 127.0.0.1: keeps every span posted to /v1/traces."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                collector.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    with self._lock:
                        self.spans.append(
                            {
                                "name": span.name,
                                "kind": span.kind,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(),
                                "service": resource.get("service.name"),
                                "role": resource.get("baton.role"),
                                "attributes": {a.key: _value(a.value) for a in span.attributes},
                            }
                        )

    def wait(self, match: Callable[[list[dict[str, Any]]], bool], timeout: float = 60) -> None:
        """Until `match` holds for the spans in so far."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if match(self.received()):
                return
            time.sleep(0.1)
        raise AssertionError(f"spans not in after {timeout} s: {self.received()}")

    def received(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.spans)


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value"))


class Stack:
    """`baton --log-format json serve` with 1 prefill + 1 decode engine, tracing to `collector`;
    its output (each child's lines under `[name] `) goes to a file."""

    def __init__(self, model: Path, log: Path, collector: Collector) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100"}  # spans out within 0.1 s
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "baton.cli", "--log-level", "INFO", "--log-format", "json",
                 "serve", "--port", str(self.port), "--model", str(model),
                 "--served-model-name", "tiny", "--prefill", "1", "--decode", "1",
                 "--otlp-traces-endpoint", collector.url,
                 "--max-model-len", "512", "--num-gpu-blocks-override", "256"],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
            )  # fmt: skip

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited early:\n{self.text()[-6000:]}"
            if "Baton is serving" in self.text():
                return
            time.sleep(0.2)
        raise AssertionError(f"serve not ready after {timeout} s:\n{self.text()[-6000:]}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def lines(self, request_id: str) -> dict[str, list[str]]:
        """Each process's JSON log messages under `request_id`, by the process's name."""
        out: dict[str, list[str]] = {}
        for line in self.text().splitlines():
            match = _LINE.match(line)
            if match is None:
                continue
            entry = json.loads(match[2])
            if entry.get("request_id") == request_id:
                out.setdefault(match[1], []).append(entry["message"])
        return out

    def wait_lines(
        self,
        request_id: str,
        names: tuple[str, ...] = ("router", "prefill-0", "decode-0"),
        timeout: float = 30,
    ) -> dict[str, list[str]]:
        """`lines` once each of `names` has logged the request's end (after its answer)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.lines(request_id)
            ended = [
                name
                for name in names
                if any(m.startswith("request finished") for m in lines.get(name, []))
            ]
            if len(ended) == len(names) or time.monotonic() > deadline:
                return lines
            time.sleep(0.1)

    def engine(self, role: str) -> str:
        engines = httpx.get(f"{self.url}/engines").json()["engines"]
        return str(next(e["url"] for e in engines if e["role"] == role))

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.server.shutdown()


@pytest.fixture(scope="module")
def stack(
    tiny_model: Any, tmp_path_factory: pytest.TempPathFactory, collector: Collector
) -> Iterator[Stack]:
    s = Stack(Path(tiny_model("llama")), tmp_path_factory.mktemp("trace") / "serve.log", collector)
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.text()[-6000:]


def _ask(stack: Stack, prompt: str, **headers: str) -> tuple[str, openai.types.Completion]:
    raw = stack.client().completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_headers=headers
    )
    return raw.headers["x-request-id"], raw.parse()


def _check_lines(stack: Stack, request_id: str) -> None:
    """The request's lines on each of the three processes: the router's name both engines
    and the hand-off's outcome, the prefill engine's its lease, the decode engine's its pull."""
    lines = stack.wait_lines(request_id)
    prefill, decode = stack.engine("prefill"), stack.engine("decode")
    router_end = [m for m in lines.get("router", []) if m.startswith("request finished")]
    assert len(router_end) == 1, lines
    assert f"baton.prefill_engine={prefill}" in router_end[0]
    assert f"baton.engine={decode}" in router_end[0]
    assert "baton.disagg.outcome=disaggregated" in router_end[0]
    assert any(m.startswith("request received") for m in lines["router"])
    prefill_lines = lines.get("prefill-0", [])
    assert any(m.startswith("request received") for m in prefill_lines), lines
    assert any("baton.kv.lease=cmpl-" in m for m in prefill_lines), lines
    decode_lines = lines.get("decode-0", [])
    assert any(re.match(r"KV pulled: [1-9]\d* bytes in ", m) for m in decode_lines), lines
    assert any(
        m.startswith("request finished") and "gen_ai.usage.completion_tokens=6" in m
        for m in decode_lines
    ), lines


@pytest.mark.slow
def test_a_client_id_reaches_every_process(stack: Stack) -> None:
    """The client's x-request-id comes back in the answer's header and names the request's
    lines on the router, the prefill engine and the decode engine."""
    request_id, answer = _ask(stack, f"client id: {PROMPT}", **{"x-request-id": "client.req:42"})
    assert request_id == "client.req:42"
    assert answer.id == "cmpl-client.req:42"  # the engines saw it too
    _check_lines(stack, request_id)


@pytest.mark.slow
def test_a_minted_id_reaches_every_process(stack: Stack) -> None:
    """Without an id (or with one that could forge log lines), the router's new id is the
    one in the header and on every process's lines."""
    for headers in ({}, {"x-request-id": "forged request_id=other"}):
        request_id, _ = _ask(stack, f"minted {len(headers)}: {PROMPT}", **headers)
        assert MINTED.fullmatch(request_id)
        _check_lines(stack, request_id)


@pytest.mark.slow
def test_streams_errors_and_engines_alone_answer_with_an_id(stack: Stack) -> None:
    """A streamed answer and the router's own error carry the id; an engine called directly
    mints one when none (or an invalid one) comes, and returns the client's."""
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/completions",
        json={"model": "tiny", "prompt": f"stream: {PROMPT}", "max_tokens": 4, "stream": True},
        headers={"x-request-id": "streamed-1"},
        timeout=60,
    ) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "streamed-1"
        assert "[DONE]" in r.read().decode()
    r = httpx.post(
        f"{stack.url}/v1/completions",
        json={"model": "nope", "prompt": "x"},
        headers={"x-request-id": "error-1"},
    )
    assert r.status_code == 404 and r.headers["x-request-id"] == "error-1"
    decode = stack.engine("decode")
    body = {"model": "tiny", "prompt": f"alone: {PROMPT}", "max_tokens": 2}
    for sent, kept in ((None, False), ("bad id", False), ("alone-1", True)):
        headers = {"x-request-id": sent} if sent is not None else {}
        r = httpx.post(f"{decode}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        got = r.headers["x-request-id"]
        assert got == sent if kept else MINTED.fullmatch(got)
        lines = stack.wait_lines(got, ("decode-0",)).get("decode-0", [])
        assert any(m.startswith("request finished") for m in lines)


def _one_trace(collector: Collector, trace_id: str) -> dict[str, dict[str, Any]]:
    """The four spans of one disaggregated request, by what they are, once all are in."""

    def named(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        out = {}
        for s in spans:
            if s["service"] == "baton-router":
                out["router"] = s
            elif s["name"] == "kv_pull":
                out["kv_pull"] = s
            elif s["service"] == "baton-engine":
                out[s["role"]] = s
        return out

    def of_trace(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [s for s in spans if s["trace_id"] == trace_id]

    collector.wait(lambda spans: len(named(of_trace(spans))) == 4)
    return named(of_trace(collector.received()))


@pytest.mark.slow
def test_one_trace_across_router_prefill_and_decode(stack: Stack, collector: Collector) -> None:
    """The router's request span, the prefill and the decode engine's request spans and the
    decode engine's kv_pull span share one trace: both engines' spans are children of the
    router's, the pull a child of the decode request's. A client's traceparent is continued."""
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    request_id, _ = _ask(
        stack, f"traced: {PROMPT}", **{"traceparent": f"00-{trace_id}-{parent}-01"}
    )
    spans = _one_trace(collector, trace_id)
    router, prefill, decode, pull = (spans[k] for k in ("router", "prefill", "decode", "kv_pull"))
    assert router["parent"] == parent and router["kind"] == 2  # SPAN_KIND_SERVER
    assert prefill["parent"] == router["span_id"] and decode["parent"] == router["span_id"]
    assert pull["parent"] == decode["span_id"]
    assert router["name"] == "POST /v1/completions"
    assert router["attributes"]["baton.disagg.outcome"] == "disaggregated"
    assert router["attributes"]["gen_ai.response.model"] == "tiny"
    assert router["attributes"]["http.response.status_code"] == 200
    for span in (router, prefill, decode):
        assert span["attributes"]["gen_ai.request.id"] == request_id
    assert decode["attributes"]["gen_ai.usage.completion_tokens"] == 6
    assert prefill["attributes"]["baton.kv.lease"].startswith("cmpl-")
    assert pull["attributes"]["baton.kv.outcome"] == "ok"
    assert pull["attributes"]["baton.kv.bytes"] > 0

    # Without a traceparent the router starts a trace of its own, with the same shape.
    request_id, _ = _ask(stack, f"untraced: {PROMPT}")
    # Each process exports on its own schedule: wait for the router's span itself.
    collector.wait(
        lambda spans: any(
            s["service"] == "baton-router"
            and s["attributes"].get("gen_ai.request.id") == request_id
            for s in spans
        )
    )
    started = next(
        s
        for s in collector.received()
        if s["service"] == "baton-router" and s["attributes"]["gen_ai.request.id"] == request_id
    )
    assert started["parent"] == ""
    spans = _one_trace(collector, started["trace_id"])
    assert spans["decode"]["parent"] == started["span_id"]
