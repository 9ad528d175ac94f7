"""One request id and one trace for a request across the router and its engines.

Every HTTP request gets an id: the client's `x-request-id` when it is a plain token (at most 128
characters of [A-Za-z0-9._:-]: anything else could forge log lines or headers), else a new one.
`RequestTracing`, ASGI middleware on the router's and the engines' apps, makes it the request's
`baton.logs.REQUEST_ID` (so every log line names it) and returns it in the response's
`x-request-id`; on the generation routes it also logs one line at the request's start and one
at its end (with what the serving code `set` on its `RequestTrace`), and makes its span. The
router sends the id, and its span as W3C `traceparent`, to both engines of a hand-off; a prefill
engine's KV lease keeps the id, so that the lease's own log lines name the request too.

Spans go to a collector over OTLP/HTTP (protobuf) only with `--otlp-traces-endpoint` (vLLM's
flag). Without it, this module imports nothing of OpenTelemetry (its SDK and exporter are never
loaded): a request's trace is its id and the attributes for its end line. All OpenTelemetry
code is `_OTLP`'s, with a provider of its own: FastAPI traces through the global one, which
stays a no-op, so no request gets a second server span.
"""

from __future__ import annotations

import argparse
import contextvars
import importlib.util
import logging
import re
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from baton.logs import REQUEST_ID

if TYPE_CHECKING:
    from fastapi.telemetry import TelemetryConfig
    from opentelemetry.trace import Span
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context
# The routes whose requests get a span and start and end lines (the others, /health and
# /metrics above all, only an id: a probe a second would drown the logs).
TRACED_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
_VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ID_HEADER = REQUEST_ID_HEADER.encode()
_TRACE_HEADERS = tuple(h.encode() for h in TRACE_HEADERS)

AttributeValue = str | int | float | bool


class SpanAttributes:
    """Span attribute names: vLLM's (vllm/tracing.py) where vLLM has one, OpenTelemetry's
    HTTP convention for the status, Baton's own under `baton.`."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    HTTP_STATUS = "http.response.status_code"
    ENGINE = "baton.engine"  # the router: the engine whose answer the client got
    PREFILL_ENGINE = "baton.prefill_engine"  # the router: the engine that computed the prompt
    DISAGG_OUTCOME = "baton.disagg.outcome"  # the router: how the hand-off went (metrics' label)
    KV_LEASE = "baton.kv.lease"  # a prefill engine: the lease its answer names
    KV_LEASED_BLOCKS = "baton.kv.leased_blocks"
    KV_BYTES = "baton.kv.bytes"  # a decode engine: what its KV pull moved
    KV_SECONDS = "baton.kv.seconds"
    KV_OUTCOME = "baton.kv.outcome"  # "ok", or the failure's reason code


# ---- request ids -----------------------------------------------------------------------------


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry spans over OTLP/HTTP (protobuf) to this collector, e.g. "
        "http://collector:4318/v1/traces (vLLM's flag; needs baton[tracing]; default: none)",
    )


# FastAPI's own OpenTelemetry (`FastAPI(telemetry=...)`), off in Baton's apps: `RequestTracing`
# makes their spans (on a provider of its own, not the global one), FastAPI looks the global
# providers up on every request to learn whether to run, and where something sets a global one
# (`opentelemetry-instrument`, FASTAPI_OTEL_AUTO_CONFIGURE) it adds a span and metrics per request.
NO_NATIVE_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}


def new_request_id() -> str:
    return uuid.uuid4().hex


def valid_request_id(value: str | None) -> str | None:
    """`value` when it may name a request in logs and headers as it is; None otherwise."""
    return value if value is not None and _VALID_ID.fullmatch(value) else None


def log_for(
    request_id: str | None, log: logging.Logger, level: int, msg: str, *args: object
) -> None:
    """Logs under `request_id`, as if its request were being served: for code that runs
    outside the request's task (the engine's output loop, the KV server's threads)."""
    if not log.isEnabledFor(level):
        return
    token = REQUEST_ID.set(request_id)
    try:
        log.log(level, msg, *args, stacklevel=2)
    finally:
        REQUEST_ID.reset(token)


# ---- one request -----------------------------------------------------------------------------


class RequestTrace:
    """One request as its log lines and spans see it: its id, the attributes the serving code
    set on it (its end line lists them), and its span when the process traces."""

    def __init__(
        self, request_id: str | None, span: Span | None = None, otlp: _OTLP | None = None
    ) -> None:
        self.request_id = request_id  # None: no request is being served
        self.attributes: dict[str, AttributeValue] = {}
        self._span = span
        self._otlp = otlp

    def set(self, key: str, value: AttributeValue) -> None:
        self.attributes[key] = value
        if self._span is not None:
            self._span.set_attribute(key, value)

    def headers(self) -> dict[str, str]:
        """`traceparent` (and `tracestate`) that make this request's span the parent of a call
        it makes; none when the process does not trace."""
        if self._span is None or self._otlp is None:
            return {}
        return self._otlp.inject(self._span)

    def child(
        self, name: str, start: float, end: float, attributes: Mapping[str, AttributeValue]
    ) -> None:
        """A finished span under this request's, from `start` to `end` (Unix seconds): work the
        process learns of once it is over, such as a KV pull done by the engine core."""
        if self._span is not None and self._otlp is not None:
            self._otlp.child(self._span, name, start, end, attributes)

    def end(self, status: int, seconds: float) -> None:
        """Ends the span with the answer's status and the request's time."""
        if self._span is not None and self._otlp is not None:
            self._span.set_attribute(SpanAttributes.HTTP_STATUS, status)
            self._span.set_attribute(SpanAttributes.GEN_AI_LATENCY_E2E, seconds)
            self._otlp.end(self._span, failed=status >= 500)

    def summary(self) -> str:
        """The attributes as `key=value, ...` for a log line."""
        return ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in self.attributes.items()
        )


_CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "baton_request_trace", default=None
)


def current() -> RequestTrace:
    """The generation request being served (`RequestTracing` sets it); outside one, a record
    that goes nowhere."""
    return _CURRENT.get() or RequestTrace(None)


# ---- the process's tracer --------------------------------------------------------------------


def check_endpoint(url: str | None) -> None:
    """Raises ValueError unless `url` (an `--otlp-traces-endpoint`) is an http(s) URL and the
    exporter is installed; None, no tracing, passes."""
    if url is None:
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"--otlp-traces-endpoint must be an http:// or https:// URL of an OTLP/HTTP "
            f"collector (e.g. http://collector:4318/v1/traces), got {url!r}"
        )
    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is None:
        raise ValueError(
            "--otlp-traces-endpoint needs OpenTelemetry's OTLP/HTTP exporter: "
            "pip install 'baton[tracing]'"
        )


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: `endpoint` as given, or with OTLP's `/v1/traces` when it
    names only the collector (`http://collector:4318`)."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return parts._replace(path="/v1/traces").geturl()
    return endpoint


class Tracer:
    """Where one process's spans go: a collector (`endpoint`), or nowhere (None, no cost).
    `service` is OpenTelemetry's service.name, `role` the process's `baton.role`."""

    def __init__(self, endpoint: str | None, service: str, role: str) -> None:
        self._otlp = _OTLP(endpoint, service, role) if endpoint is not None else None

    def start(self, name: str, headers: Mapping[str, str], request_id: str) -> RequestTrace:
        """A request's trace; its span (a SERVER span, continuing the trace `headers` carry)
        only when the process traces."""
        if self._otlp is None:
            return RequestTrace(request_id)
        return RequestTrace(
            request_id, self._otlp.server_span(name, headers, request_id), self._otlp
        )

    def shutdown(self) -> None:
        """Exports the spans still queued and stops (blocks up to the exporter's timeout)."""
        if self._otlp is not None:
            self._otlp.shutdown()


class _OTLP:
    """The OpenTelemetry SDK behind a `Tracer`: a provider of its own (no global one, so that
    several servers in one process keep theirs), batching spans to an OTLP/HTTP exporter.
    Imported here only, when tracing is on."""

    def __init__(self, endpoint: str, service: str, role: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": service, "baton.role": role})
        # Shut down by the server as it stops, not at exit: by then its loop and logs are gone.
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("baton")
        self._propagator = TraceContextTextMapPropagator()
        self._server, self._internal = SpanKind.SERVER, SpanKind.INTERNAL
        self._error = Status(StatusCode.ERROR)
        self._in_context = set_span_in_context

    def server_span(self, name: str, headers: Mapping[str, str], request_id: str) -> Span:
        parent = self._propagator.extract(headers)
        return self._tracer.start_span(
            name,
            context=parent,
            kind=self._server,
            attributes={SpanAttributes.GEN_AI_REQUEST_ID: request_id},
        )

    def inject(self, span: Span) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._in_context(span))
        return carrier

    def child(
        self,
        parent: Span,
        name: str,
        start: float,
        end: float,
        attributes: Mapping[str, AttributeValue],
    ) -> None:
        span = self._tracer.start_span(
            name,
            context=self._in_context(parent),
            kind=self._internal,
            attributes=attributes,
            start_time=int(start * 1e9),
        )
        span.end(end_time=int(end * 1e9))

    def end(self, span: Span, failed: bool) -> None:
        if failed:
            span.set_status(self._error)
        span.end()

    def shutdown(self) -> None:
        self._provider.shutdown()


# ---- the middleware --------------------------------------------------------------------------


class RequestTracing:
    """ASGI middleware: every HTTP request's id (the module docstring says which), in the logs
    and the response's `x-request-id`; on `TRACED_PATHS`, its `RequestTrace` (`current()`),
    its span, and a log line at its start and at its end.

    `forward_id`, for the router, which forwards the id: a request without one gets the new id
    in its headers, where the app reads what it forwards. An engine leaves such a request as it
    came, since its body's `request_id` may name the response. A replaced invalid id is
    replaced in the headers in both.
    """

    def __init__(self, app: ASGIApp, tracer: Tracer, forward_id: bool = False) -> None:
        self.app = app
        self.tracer = tracer
        self.forward_id = forward_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        sent = next((v.decode("latin-1") for k, v in headers if k == _ID_HEADER), None)
        request_id = valid_request_id(sent) or new_request_id()
        if request_id != sent and (sent is not None or self.forward_id):
            kept = [h for h in headers if h[0] != _ID_HEADER]
            scope = {**scope, "headers": [*kept, (_ID_HEADER, request_id.encode())]}
        id_header = (_ID_HEADER, request_id.encode())
        status = [500]  # what a request that raised before its answer ends with

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [h for h in message.get("headers", ()) if h[0].lower() != _ID_HEADER]
                message = {**message, "headers": [*kept, id_header]}
                status[0] = message["status"]
            await send(message)

        id_token = REQUEST_ID.set(request_id)
        method, path = scope["method"], scope["path"]
        if method != "POST" or path not in TRACED_PATHS:
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                REQUEST_ID.reset(id_token)
            return
        trace_headers = {k.decode(): v.decode("latin-1") for k, v in headers if k in _TRACE_HEADERS}
        trace = self.tracer.start(f"{method} {path}", trace_headers, request_id)
        trace_token = _CURRENT.set(trace)
        started = time.perf_counter()
        logger.info("request received: %s %s", method, path)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            trace.end(status[0], seconds)
            logger.info(
                "request finished: %s %s %d in %.3f s (%s)",
                method, path, status[0], seconds, trace.summary(),
            )  # fmt: skip
            _CURRENT.reset(trace_token)
            REQUEST_ID.reset(id_token)
