"""The OpenAI-compatible engine server: a FastAPI app over one `AsyncLLM`, and its lifecycle.

`build_app` makes the app (routes, error shapes, body limit, metrics); `run_server` starts the
EngineCore, serves until SIGTERM (drain: new requests get 503, in-flight ones finish within
`shutdown_timeout`, exit 0) or until the core dies (every open request fails with 503 at once,
exit 1, so Kubernetes restarts the pod).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, cast

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton.engine.api import protocol as p
from baton.engine.api.metrics import CONTENT_TYPE, EngineMetrics, RequestTimer
from baton.engine.async_llm import AsyncLLM, EngineDeadError
from baton.engine.config import EngineArgs
from baton.engine.outputs import RequestOutput
from baton.engine.processor import check_prompt_token_ids
from baton.engine.sampling_params import SamplingParams
from baton.engine.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)

_DEAD_FLUSH_SECONDS = 2.0  # after the core died: time for open requests to send their errors


@dataclass(frozen=True)
class ServerConfig:
    """How the API server listens and admits requests (the engine has its own `EngineArgs`)."""

    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str | None = None  # None: the model folder's name
    max_waiting_requests: int | None = None  # 429 once the engine has this many waiting
    max_body_bytes: int = 10 << 20  # 413 past this
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    engine_label: str = "0"  # the `engine` label of every metric
    uvicorn_log_level: str = "info"
    access_log: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")


# ---- one prompt's stream -------------------------------------------------------------------


class _PromptStream:
    """One prompt's snapshots from the engine, with its metrics; errors become `APIError`s."""

    def __init__(
        self,
        llm: AsyncLLM,
        metrics: EngineMetrics,
        request_id: str,
        prompt: tuple[str | None, list[int]],
        params: SamplingParams,
        priority: int,
    ) -> None:
        text, ids = prompt
        gen = llm.generate(request_id, ids, params, prompt=text, priority=priority)
        self._gen = cast("AsyncGenerator[RequestOutput, None]", gen)
        self._timer = RequestTimer(metrics, len(ids), params.n)
        self._closed = False
        self.last: RequestOutput | None = None

    async def next(self) -> RequestOutput | None:
        """The next snapshot, or None once the request has finished."""
        if self.last is not None and self.last.finished:
            return None
        try:
            out = await anext(self._gen)
        except StopAsyncIteration:
            return None
        except ValueError as e:  # raised before anything is queued: a bad prompt
            raise p.APIError(400, str(e), "prompt") from None
        except EngineDeadError as e:
            raise p.APIError(503, str(e)) from None
        self._timer.on_output(out)
        self.last = out
        return out

    async def close(self) -> None:
        """Aborts the request in the engine unless it finished (idempotent)."""
        if not self._closed:
            self._closed = True
            self._timer.on_closed()
            await self._gen.aclose()


async def _merge(streams: list[_PromptStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Later snapshots of several prompts, as they come. A stream's next snapshot is asked for
    only after the consumer took its previous one (snapshots share lists with the engine)."""
    if len(streams) == 1:
        while (out := await streams[0].next()) is not None:
            yield 0, out
        return
    pending = {asyncio.ensure_future(s.next()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if out is not None:
                    yield i, out
                    pending[asyncio.ensure_future(streams[i].next())] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _collect(streams: list[_PromptStream]) -> list[RequestOutput]:
    """Every prompt's final snapshot."""

    async def run(stream: _PromptStream) -> RequestOutput:
        while await stream.next() is not None:
            pass
        if stream.last is None:
            raise p.APIError(500, "the engine ended a request without output")
        return stream.last

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(run(s)) for s in streams]
    return [t.result() for t in tasks]


def _finish_reason(delta: p.Delta) -> str | None:
    if delta.finish_reason == "abort":  # never shown to a client as a finish reason
        raise p.APIError(500, "the engine aborted the request")
    return delta.finish_reason


class _EventStream(StreamingResponse):
    """Server-sent events whose cleanup runs however the response ends, even if the body was
    never iterated (a client gone before the first byte): it aborts the engine requests."""

    def __init__(
        self, content: AsyncGenerator[str, None], cleanup: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._events = content
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # runs its `finally` if it was left at a `yield`
            await self._cleanup()


# ---- the app -------------------------------------------------------------------------------


class EngineServer:
    """The routes' logic over one engine; `build_app` wires it into FastAPI."""

    def __init__(self, llm: AsyncLLM, config: ServerConfig) -> None:
        self.llm = llm
        self.config = config
        self.tokenizer = llm.tokenizer
        self.model_name = config.served_model_name or llm.model_path.name
        self.metrics = EngineMetrics(lambda: llm.stats, self.model_name, config.engine_label)
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def decode_token(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    # -- admission and the drain --

    def _admit(self, model: str | None) -> Callable[[], None]:
        """Checks a generation request may start; returns the call that ends its tracking."""
        self._check_model(model)
        if self.llm.dead_error is not None:
            raise p.APIError(503, f"the engine is dead: {self.llm.dead_error}")
        if self.draining:
            raise p.APIError(503, "the server is shutting down")
        bound = self.config.max_waiting_requests
        if bound is not None and self.llm.stats.num_waiting >= bound:
            raise p.APIError(
                429,
                f"too many requests waiting ({self.llm.stats.num_waiting} >= {bound}); retry later",
            )
        self.num_in_flight += 1
        self._idle.clear()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.num_in_flight -= 1
                if self.num_in_flight == 0:
                    self._idle.set()

        return release

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def healthy(self) -> bool:
        return self.llm.dead_error is None and not self.draining

    # -- prompts --

    def _tokenize_prompt(
        self, prompt: str | list[int], add_special_tokens: bool, echo: bool
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(
                self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            )
        return (str(self.tokenizer.decode(prompt)) if echo else None), prompt

    def _check_prompt(self, ids: list[int], param: str) -> None:
        try:
            check_prompt_token_ids(ids, self.llm.max_model_len, self.llm.model_config.vocab_size)
        except ValueError as e:
            raise p.APIError(400, str(e), param) from None

    def _chat_prompt(
        self, messages: list[p.ChatMessage], add_generation_prompt: bool, template: str | None
    ) -> list[int]:
        try:
            return apply_chat_template(
                self.tokenizer, [m.to_template() for m in messages], add_generation_prompt, template
            )
        except ValueError as e:
            raise p.APIError(400, str(e), "messages") from None
        except Exception as e:  # a template that fails to render
            raise p.APIError(400, f"the chat template failed: {e}", "messages") from None

    # -- completions --

    async def completions(self, req: p.CompletionRequest) -> Response:
        req.check()
        self._check_model(req.model)
        rid = req.request_id or p.random_id()
        inputs = []
        for prompt in req.prompts():
            text, ids = self._tokenize_prompt(prompt, req.add_special_tokens, req.echo)
            max_tokens = p.resolve_max_tokens(
                req.max_tokens, 16, len(ids), self.llm.max_model_len, "prompt"
            )
            self._check_prompt(ids, "prompt")
            inputs.append(((text, ids), req.to_sampling_params(max_tokens)))
        release = self._admit(req.model)
        streams = [
            _PromptStream(self.llm, self.metrics, f"cmpl-{rid}-{i}", prompt, params, req.priority)
            for i, (prompt, params) in enumerate(inputs)
        ]
        response_id, created = f"cmpl-{rid}", int(time.time())
        if not req.stream:
            return await self._respond(
                streams,
                release,
                lambda outs: p.completion_response(
                    req, response_id, created, self.model_name, outs, self.decode_token
                ),
            )
        holdback = p.stop_holdback(req.stop_list())
        cursors = [[p.SampleCursor(holdback) for _ in range(req.n)] for _ in streams]
        usage: dict[str, Any] = {"usage": None} if req.include_usage() else {}

        def chunk(choices: list[p.CompletionChoice], **extra: Any) -> str:
            return p.sse(
                p.CompletionChunk(
                    id=response_id, created=created, model=self.model_name, choices=choices, **extra
                )
            )

        def chunks(i: int, out: RequestOutput) -> Iterator[str]:
            for sample in out.outputs:
                cursor = cursors[i][sample.index]
                started = cursor.started
                delta = cursor.advance(sample)
                if delta is None:
                    continue
                text, ids = delta.text, delta.token_ids
                entries: list[Any] = list(delta.logprobs or [])
                if req.echo and not started:
                    text = (out.prompt or "") + text
                    ids = out.prompt_token_ids + ids
                    entries = [None] * len(out.prompt_token_ids) + entries
                shown = text or delta.finish_reason or req.logprobs is not None
                if not (shown or req.return_token_ids):
                    continue  # tokens whose text is held back: nothing to show yet
                choice: dict[str, Any] = {
                    "index": i * req.n + sample.index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": _finish_reason(delta),
                    "stop_reason": delta.stop_reason,
                }
                if req.logprobs is not None:
                    choice["logprobs"], cursor.text_offset = p.completion_logprobs(
                        ids, entries, req.logprobs, cursor.text_offset, self.decode_token
                    )
                if req.return_token_ids:
                    choice["token_ids"] = delta.token_ids
                    if not started:
                        choice["prompt_token_ids"] = out.prompt_token_ids
                yield chunk([p.CompletionChoice(**choice)], **usage)

        return self._stream(
            streams, release, [], chunks, lambda u: chunk([], usage=u) if usage else None
        )

    # -- chat completions --

    async def chat_completions(self, req: p.ChatCompletionRequest) -> Response:
        req.check()
        self._check_model(req.model)
        rid = req.request_id or p.random_id()
        ids = self._chat_prompt(req.messages, req.add_generation_prompt, req.chat_template)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = p.resolve_max_tokens(
            req.requested_max_tokens(), None, len(ids), self.llm.max_model_len, "messages", param
        )
        self._check_prompt(ids, "messages")
        params = req.to_sampling_params(max_tokens)
        release = self._admit(req.model)
        streams = [
            _PromptStream(
                self.llm, self.metrics, f"chatcmpl-{rid}", (None, ids), params, req.priority
            )
        ]
        response_id, created = f"chatcmpl-{rid}", int(time.time())
        if not req.stream:
            return await self._respond(
                streams,
                release,
                lambda outs: p.chat_response(
                    req, response_id, created, self.model_name, outs[0], self.decode_token
                ),
            )
        cursors = [p.SampleCursor(p.stop_holdback(req.stop_list())) for _ in range(req.n)]
        usage: dict[str, Any] = {"usage": None} if req.include_usage() else {}

        def chunk(choices: list[p.ChatStreamChoice], **extra: Any) -> str:
            return p.sse(
                p.ChatCompletionChunk(
                    id=response_id, created=created, model=self.model_name, choices=choices, **extra
                )
            )

        def chunks(_: int, out: RequestOutput) -> Iterator[str]:
            for sample in out.outputs:
                delta = cursors[sample.index].advance(sample)
                if delta is None:
                    continue
                if not (delta.text or delta.finish_reason or req.logprobs or req.return_token_ids):
                    continue  # tokens whose text is held back: nothing to show yet
                choice: dict[str, Any] = {
                    "index": sample.index,
                    "delta": p.DeltaMessage(content=delta.text) if delta.text else p.DeltaMessage(),
                    "logprobs": None,
                    "finish_reason": _finish_reason(delta),
                    "stop_reason": delta.stop_reason,
                }
                if req.logprobs:
                    choice["logprobs"] = p.chat_logprobs(
                        delta.token_ids,
                        delta.logprobs or [],
                        req.top_logprobs or 0,
                        self.decode_token,
                    )
                if req.return_token_ids:
                    choice["token_ids"] = delta.token_ids
                yield chunk([p.ChatStreamChoice(**choice)], **usage)

        # OpenAI opens each choice with the assistant role and empty content.
        head = []
        for index in range(req.n):
            role = p.DeltaMessage(role="assistant", content="")
            choice = p.ChatStreamChoice(index=index, delta=role, logprobs=None, finish_reason=None)
            first = {"prompt_token_ids": ids} if req.return_token_ids and index == 0 else {}
            head.append(chunk([choice], **usage, **first))
        return self._stream(
            streams, release, head, chunks, lambda u: chunk([], usage=u) if usage else None
        )

    # -- both --

    async def _respond(
        self,
        streams: list[_PromptStream],
        release: Callable[[], None],
        body: Callable[[list[RequestOutput]], BaseModel],
    ) -> Response:
        """A non-streaming answer: waits for every prompt, then answers at once."""
        try:
            outputs = await _collect(streams)
            for out in outputs:
                if any(s.finish_reason == "abort" for s in out.outputs):
                    raise p.APIError(500, "the engine aborted the request")
            return JSONResponse(body(outputs).model_dump(mode="json"))
        finally:
            await _cleanup(streams, release)()

    def _stream(
        self,
        streams: list[_PromptStream],
        release: Callable[[], None],
        head: list[str],
        chunks: Callable[[int, RequestOutput], Iterator[str]],
        usage_chunk: Callable[[p.UsageInfo], str | None],
    ) -> Response:
        """A streaming answer: `head`, the chunks of each snapshot, the usage chunk if asked
        for, `[DONE]`. An error after the headers went out is an error event, then `[DONE]`."""
        cleanup = _cleanup(streams, release)

        async def events() -> AsyncGenerator[str, None]:
            try:
                for event in head:
                    yield event
                async for i, out in _merge(streams):
                    for event in chunks(i, out):
                        yield event
                last = usage_chunk(p.usage_of([s.last for s in streams if s.last is not None]))
                if last is not None:
                    yield last
                yield p.DONE
            except p.APIError as e:
                yield p.sse_error(e)
                yield p.DONE
            finally:
                await cleanup()

        return _EventStream(events(), cleanup)

    # -- tokenizer routes --

    def tokenize(self, req: p.TokenizeRequest) -> p.TokenizeResponse:
        req.check()
        self._check_model(req.model)
        if req.messages is not None:
            ids = self._chat_prompt(req.messages, req.add_generation_prompt, None)
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = list(self.tokenizer.encode(req.prompt or "", add_special_tokens=add_special))
        strs = list(self.tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        return p.TokenizeResponse(
            count=len(ids), max_model_len=self.llm.max_model_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self._check_model(req.model)
        vocab = self.llm.model_config.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise p.APIError(400, f"token ids outside [0, {vocab}): {bad[:5]}", "tokens")
        return p.DetokenizeResponse(prompt=str(self.tokenizer.decode(req.tokens)))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise p.APIError(404, f"The model `{model}` does not exist.", "model")

    def models(self) -> p.ModelList:
        card = p.ModelCard(
            id=self.model_name, root=str(self.llm.model_path), max_model_len=self.llm.max_model_len
        )
        return p.ModelList(data=[card])


def _cleanup(
    streams: list[_PromptStream], release: Callable[[], None]
) -> Callable[[], Awaitable[None]]:
    async def cleanup() -> None:
        try:
            for s in streams:
                await s.close()
        finally:
            release()

    return cleanup


async def _cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Runs `work`, cancelling it if the client disconnects first (its engine requests abort)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening
    return task.result()


def _error(error: p.APIError) -> JSONResponse:
    return JSONResponse(error.response().model_dump(mode="json"), status_code=error.status)


class _BodyLimit:
    """Answers 413 to a body over `max_bytes`, by its Content-Length or by what arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = p.APIError(413, f"the request body is larger than {self.max_bytes} bytes")
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await _error(p.APIError(400, "invalid Content-Length"))(scope, receive, send)
                return
            if int(length) > self.max_bytes:
                await _error(too_large)(scope, receive, send)
                return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await _error(too_large)(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def build_app(llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `llm`; `app.state.server` is its `EngineServer`."""
    server = EngineServer(llm, config)
    app = FastAPI(title="Baton engine", description="OpenAI-compatible API (vLLM's shapes)")
    app.state.server = server

    @app.exception_handler(p.APIError)
    async def api_error(_: Request, exc: p.APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(_from_validation(exc))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return _error(p.APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return _error(p.APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": p.ErrorResponse} for code in (400, 404, 413, 429, 503)
    }

    @app.get("/health", responses={503: {"model": p.ErrorResponse}})
    async def health() -> Response:
        """200 while the engine serves; 503 when draining or the engine died."""
        if not server.healthy():
            return _error(p.APIError(503, "draining" if server.draining else "the engine is dead"))
        return Response(status_code=200)

    @app.get("/v1/models", response_model=p.ModelList)
    async def models() -> p.ModelList:
        return server.models()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses=errors)
    async def tokenize(req: p.TokenizeRequest) -> p.TokenizeResponse:
        return server.tokenize(req)

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=errors)
    async def detokenize(req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        return server.detokenize(req)

    @app.post("/v1/completions", responses={200: {"model": p.CompletionResponse}, **errors})
    async def completions(req: p.CompletionRequest, raw: Request) -> Response:
        return await _cancel_on_disconnect(raw, server.completions(req))

    @app.post(
        "/v1/chat/completions", responses={200: {"model": p.ChatCompletionResponse}, **errors}
    )
    async def chat_completions(req: p.ChatCompletionRequest, raw: Request) -> Response:
        return await _cancel_on_disconnect(raw, server.chat_completions(req))

    app.add_middleware(_BodyLimit, max_bytes=config.max_body_bytes)
    return app


def _from_validation(exc: RequestValidationError) -> p.APIError:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return p.APIError(
                400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}"
            )
        field = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{field}: {err.get('msg')}" if field else str(err.get("msg")))
    return p.APIError(400, "; ".join(parts) or "invalid request", param)


# ---- lifecycle -----------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: `run_server` owns SIGTERM (the drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run_server(engine_args: EngineArgs, config: ServerConfig) -> int:
    """Starts the engine, serves until SIGTERM or the engine's death; returns the exit code.

    SIGTERM (or SIGINT): stop admitting (503), let in-flight requests finish within
    `shutdown_timeout`, exit 0. A second signal exits at once. The core's death: every open
    request has already failed with 503; give them a moment to flush, exit 1.
    """
    # vLLM's exposition has no `_created` series; this is a process-wide prometheus switch.
    prometheus_client.disable_created_metrics()
    llm = await AsyncLLM.start(engine_args)
    app = build_app(llm, config)
    server: EngineServer = app.state.server
    uv = _Uvicorn(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.uvicorn_log_level,
            access_log=config.access_log,
            lifespan="off",
            timeout_graceful_shutdown=2,  # the drain happened already, see below
        )
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if server.draining:  # a second signal: no more patience
            uv.force_exit = uv.should_exit = True
            return
        logger.info("%s: draining %d in-flight requests", sig.name, server.num_in_flight)
        server.draining = True
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    llm.add_dead_callback(lambda _: stop.set())
    serving = asyncio.create_task(uv.serve())
    stopped = asyncio.create_task(stop.wait())
    exit_code = 0
    try:
        await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():  # uvicorn could not start (port taken, ...)
            serving.result()
            return 1
        if llm.dead_error is not None:
            exit_code = 1
            await server.wait_idle(_DEAD_FLUSH_SECONDS)
        elif not await server.wait_idle(config.shutdown_timeout):
            logger.warning(
                "shutdown timeout (%.0f s): cutting %d requests",
                config.shutdown_timeout,
                server.num_in_flight,
            )
        uv.should_exit = True
        await serving
    finally:
        stopped.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        try:
            await asyncio.wait_for(llm.shutdown(), 10)
        except Exception:
            logger.exception("engine shutdown failed")
    logger.info("server stopped (exit code %d)", exit_code)
    return exit_code


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The engine server's flags, under vLLM's names."""
    e, s = EngineArgs, ServerConfig
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--host", default=s.host)
    parser.add_argument("--port", type=int, default=s.port)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-model-len", type=int, default=e.max_model_len)
    parser.add_argument("--block-size", type=int, default=e.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=e.enable_prefix_caching,
    )
    parser.add_argument("--dtype", default=e.dtype)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=e.num_gpu_blocks_override)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=e.kv_cache_memory_bytes)
    parser.add_argument("--gpu-memory-utilization", type=float, default=e.gpu_memory_utilization)
    parser.add_argument("--seed", type=int, default=e.seed)
    parser.add_argument("--scheduling-policy", default=e.scheduling_policy)
    parser.add_argument("--device", default=e.device)
    parser.add_argument("--attention-backend", default=e.attention_backend)
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=e.async_scheduling
    )
    parser.add_argument("--max-waiting-requests", type=int, default=s.max_waiting_requests)
    parser.add_argument("--max-body-bytes", type=int, default=s.max_body_bytes)
    parser.add_argument("--shutdown-timeout", type=float, default=s.shutdown_timeout)
    parser.add_argument("--uvicorn-log-level", default=s.uvicorn_log_level)
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")


def configs_from_args(args: argparse.Namespace) -> tuple[EngineArgs, ServerConfig]:
    """`EngineArgs` and `ServerConfig` from `add_server_args`' flags; ValueError if invalid."""
    engine = EngineArgs(
        model=args.model,
        tokenizer=args.tokenizer,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        dtype=args.dtype,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        scheduling_policy=args.scheduling_policy,
        device=args.device,
        attention_backend=args.attention_backend,
        async_scheduling=args.async_scheduling,
    )
    server = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
    )
    return engine, server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="baton engine", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    add_server_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        engine_args, server_config = configs_from_args(args)
        code = asyncio.run(run_server(engine_args, server_config))
    except (ValueError, FileNotFoundError) as e:
        print(f"baton engine: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
