"""A fast fake engine for the router's tests and benchmark: the engine server's OpenAI routes,
streaming, /health, /metrics and the prefill→decode `kv_transfer_params` contract, with knobs
for latency and failures. No model: the answer to a prompt is a fixed function of the prompt,
so an answer computed locally, and one computed after a (fake) KV hand-off, are equal.

The knobs are plain attributes of `FakeEngine`, changed by tests while the server runs.
`python -m tests.support.fake_engine --port P` serves one on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from baton.roles import Role


@dataclass
class Lease:
    """A prompt whose (fake) KV blocks a prefill engine keeps for a decode engine."""

    engine_id: str
    prompt_key: int
    expires_at: float
    fingerprint: str | None = None  # the prefill engine's, as a real engine signs it in
    read: bool = False


@dataclass
class LeaseBoard:
    """The leases of every fake prefill engine in a test, so a fake decode engine can check
    that the params it received name a real, unread lease for the same prompt."""

    leases: dict[str, Lease] = field(default_factory=dict)


def _error(status: int, message: str) -> JSONResponse:
    kind = {
        400: "BadRequestError",
        401: "Unauthorized",
        404: "NotFoundError",
        429: "TooManyRequests",
    }
    body = {
        "object": "error",
        "error": {
            "message": message,
            "type": kind.get(status, "ServiceUnavailable"),
            "param": None,
            "code": status,
        },
    }
    return JSONResponse(body, status_code=status)


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "".join(f"<{m.get('role')}>{m.get('content')}" for m in body["messages"])
    return json.dumps(body.get("prompt"))


def _compact(event: dict[str, Any]) -> str:
    """A chunk written as Baton's and vLLM's engines write them (pydantic: no spaces)."""
    return json.dumps(event, separators=(",", ":"))


def token_text(prompt_key: int, i: int) -> str:
    """The i-th generated token of the prompt with `prompt_key`."""
    return f" t{(prompt_key + 7919 * i) % 1000}"


class FakeEngine:
    """One fake engine server; `app` is its ASGI app."""

    def __init__(
        self, model: str = "fake", role: Role = "both", board: LeaseBoard | None = None
    ) -> None:
        self.model = model
        self.role = role
        self.board = board or LeaseBoard()
        self.engine_id = uuid.uuid4().hex  # changes on every start, as a real engine's
        self.port = 0  # set by whoever serves it, for the params it hands out
        # -- knobs --
        self.ttft = 0.0  # seconds before the first token
        self.itl = 0.0  # seconds between tokens
        self.token_padding = 0  # spaces after each token's text (long streams in few tokens)
        self.fail_status: int | None = None  # answer generation requests with this status
        self.break_after_chunks: int | None = None  # a stream dies after this many chunks
        # A stream ends with an error event of this code after `break_after_chunks` instead
        # (a draining engine's 503, or a client's 4xx).
        self.error_event_code: int | None = None
        self.healthy = True
        self.running = 0.0  # vllm:num_requests_running reported on top of in-flight requests
        self.waiting = 0.0
        self.omit_kv_params = False  # a prefill engine that forgets its half of the contract
        self.tensor_parallel_size: int | None = None  # said in /health when set
        # Said in /health when set; a decode engine refuses a lease of another fingerprint, as
        # a real one does (it would read blocks that mean something else).
        self.fingerprint: str | None = None
        # Set: said in /health (the transport really in use), and /metrics has the pull
        # counters of baton:kv_transfer_*, as a real engine with a KV connector.
        self.kv_transport: str | None = None
        self.block_size = 16  # said in /health's compatibility when the fingerprint is set
        self.block_bytes = 4096  # KV bytes of one block, counted per pulled block
        self.pull_seconds = 0.0  # how long a (fake) pull takes
        self.pull_failure: str | None = None  # every pull fails with this reason
        self.load_failure_policy = "recompute"  # unless the request's params say otherwise
        self.api_key: str | None = None  # generation requests need `Authorization: Bearer` it
        # -- what happened --
        self.requests: list[dict[str, Any]] = []  # generation request bodies, in order
        self.tokenize_requests: list[dict[str, Any]] = []  # /tokenize bodies, in order
        self.in_flight = 0
        self.disconnects = 0  # streams whose client left early
        self.prefills = 0  # requests answered as a prefill for a remote decode
        self.remote_decodes = 0  # requests decoded after reading a remote prefill's lease
        self.read_from: list[str] = []  # the engine id of each lease read, in order
        self.kv_bytes = 0  # pulled, as baton:kv_transfer_bytes_total
        self.kv_pull_seconds: list[float] = []  # each pull's, as baton:kv_transfer_seconds
        self.kv_failures: dict[str, int] = {}  # as baton:kv_transfer_failures_total{reason}
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.generate, methods=["POST"]),
                Route("/v1/chat/completions", self.generate, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/health", self.health),
                Route("/metrics", self.metrics),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
            ]
        )

    # -- routes --

    async def health(self, _: Request) -> Response:
        status = 200 if self.healthy else 503
        said = (self.tensor_parallel_size, self.fingerprint, self.kv_transport)
        if all(value is None for value in said):
            return Response(status_code=status)  # an engine of an older Baton says nothing
        body: dict[str, Any] = {"status": "ok"}
        if self.kv_transport is not None:
            body.update(kv_transport=self.kv_transport, role=self.role)
        if self.tensor_parallel_size is not None:
            body["tensor_parallel_size"] = self.tensor_parallel_size
        if self.fingerprint is not None:
            body["fingerprint"] = self.fingerprint
            compatibility = {"weights": self.fingerprint[:8], "block_size": self.block_size}
            body["compatibility"] = compatibility
        return JSONResponse(body, status_code=status)

    async def models(self, _: Request) -> Response:
        card = {"id": self.model, "object": "model", "owned_by": "fake", "root": f"/{self.model}"}
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(self, _: Request) -> Response:
        labels = f'{{model_name="{self.model}",engine="0"}}'
        lines = [
            f"vllm:num_requests_running{labels} {self.running + self.in_flight}",
            f"vllm:num_requests_waiting{labels} {self.waiting}",
            f"vllm:kv_cache_usage_perc{labels} 0.0",
        ]
        if self.kv_transport is not None:
            pulls = self.kv_pull_seconds
            lines += [
                f"baton:kv_transfer_bytes_total{labels} {float(self.kv_bytes)}",
                f"baton:kv_transfer_seconds_sum{labels} {sum(pulls)}",
                f"baton:kv_transfer_seconds_count{labels} {float(len(pulls))}",
            ]
            for reason, count in self.kv_failures.items():
                failure = f'{{model_name="{self.model}",engine="0",reason="{reason}"}}'
                lines.append(f"baton:kv_transfer_failures_total{failure} {float(count)}")
        return Response("\n".join(lines) + "\n", media_type="text/plain")

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        self.tokenize_requests.append(body)
        ids = list(str(body.get("prompt", "")).encode())
        return JSONResponse({"count": len(ids), "max_model_len": 1024, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"prompt": bytes(body["tokens"]).decode(errors="replace")})

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        wanted = f"Bearer {self.api_key}"
        if self.api_key is not None and request.headers.get("authorization") != wanted:
            return _error(401, "Unauthorized: a valid API key is required")
        if self.fail_status is not None:
            return _error(self.fail_status, f"fake engine set to answer {self.fail_status}")
        if body.get("model") not in (None, self.model):
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        chat = request.url.path.endswith("/chat/completions")
        prompt = _prompt_text(body)
        key = zlib.crc32(prompt.encode())
        params = body.get("kv_transfer_params") or {}
        kv_out = None
        if params.get("do_remote_decode"):
            problem = self._check_prefill_request(body, chat)
            if problem:
                return _error(400, problem)
            kv_out = self._lease(key, len(prompt))
        elif params.get("do_remote_prefill"):
            problem = self._read_lease(params, key)
            if problem:
                return _error(400, problem)
            failed = await self._pull(params)
            policy = params.get("kv_load_failure_policy") or self.load_failure_policy
            if failed and policy == "fail":
                return _error(503, f"the KV pull failed ({failed}); policy fail")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        # A resumed stream goes on after the tokens given (token i's id is i), as an engine
        # does; usage counts the whole answer.
        start = len(body.get("resume_token_ids") or [])
        pad = " " * self.token_padding
        texts = [token_text(key, i) + pad for i in range(int(max_tokens))]
        usage = {
            "prompt_tokens": len(prompt) // 4,
            "completion_tokens": len(texts),
            "total_tokens": len(prompt) // 4 + len(texts),
        }
        if body.get("stream"):
            include_usage = (body.get("stream_options") or {}).get("include_usage", False)
            return StreamingResponse(
                self._events(
                    chat,
                    texts,
                    usage if include_usage else None,
                    start,
                    bool(body.get("return_token_ids")),
                ),
                media_type="text/event-stream",
            )
        self.in_flight += 1
        try:  # "computing", in slices, so a client that leaves is noticed as an engine would
            deadline = time.monotonic() + self.ttft + self.itl * max(0, len(texts) - 1)
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    self.disconnects += 1
                    return Response(status_code=499)
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        finally:
            self.in_flight -= 1
        text = "".join(texts)
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
        answer = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": usage,
            "kv_transfer_params": None if self.omit_kv_params else kv_out,
        }
        return JSONResponse(answer)

    # -- the hand-off contract --

    def _check_prefill_request(self, body: dict[str, Any], chat: bool) -> str | None:
        if body.get("max_tokens") != 1 or body.get("stream"):
            return "a prefill request must have max_tokens=1 and stream=false"
        if chat and body.get("max_completion_tokens") != 1:
            return "a chat prefill request must have max_completion_tokens=1"
        if "stream_options" in body:
            return "stream_options without stream"
        return None

    def _lease(self, key: int, num_prompt_tokens: int) -> dict[str, Any]:
        self.prefills += 1
        request_id = uuid.uuid4().hex
        expires = time.time() + 30
        self.board.leases[request_id] = Lease(self.engine_id, key, expires, self.fingerprint)
        return {
            "remote_engine_id": self.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.port,
            "remote_request_id": request_id,
            "remote_block_ids": list(range(max(1, num_prompt_tokens // 16))),
            "num_prompt_tokens": num_prompt_tokens,
            "lease_expires_at": expires,
        }

    def _read_lease(self, params: dict[str, Any], key: int) -> str | None:
        lease = self.board.leases.get(str(params.get("remote_request_id")))
        if lease is None:
            return "kv_transfer_params name no lease"
        if lease.engine_id != params.get("remote_engine_id") or lease.prompt_key != key:
            return "kv_transfer_params name another engine's or another prompt's lease"
        if lease.read:
            return "the lease was read already"
        mine, theirs = self.fingerprint, lease.fingerprint
        if mine is not None and theirs is not None and mine != theirs:
            return f"the prefill engine's fingerprint {theirs} is not this engine's {mine}"
        lease.read = True
        self.remote_decodes += 1
        self.read_from.append(lease.engine_id)
        return None

    async def _pull(self, params: dict[str, Any]) -> str | None:
        """The (fake) pull of a lease's blocks, counted as a real engine counts it; the failure
        reason, if it fails."""
        await asyncio.sleep(self.pull_seconds)
        self.kv_pull_seconds.append(self.pull_seconds)
        if self.pull_failure is not None:
            self.kv_failures[self.pull_failure] = self.kv_failures.get(self.pull_failure, 0) + 1
            return self.pull_failure
        self.kv_bytes += len(params.get("remote_block_ids") or []) * self.block_bytes
        return None

    # -- streaming --

    async def _events(
        self,
        chat: bool,
        texts: list[str],
        usage: dict[str, int] | None,
        start: int = 0,
        token_ids: bool = False,
    ) -> AsyncIterator[bytes]:
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        self.in_flight += 1
        sent = 0
        try:
            await asyncio.sleep(self.ttft)
            for i, text in enumerate(texts):
                if i < start:
                    continue
                if i > start:
                    await asyncio.sleep(self.itl)
                if self.break_after_chunks is not None and sent >= self.break_after_chunks:
                    if self.error_event_code is None:
                        raise ConnectionAbortedError("fake engine stream broken on purpose")
                    error = {"message": "fake engine error event", "code": self.error_event_code}
                    yield f"data: {json.dumps({'object': 'error', 'error': error})}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                    return
                last = i == len(texts) - 1
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
                if chat:
                    choice["delta"] = {"content": text}
                else:
                    choice["text"] = text
                if token_ids:
                    choice["token_ids"] = [i]
                event = {"id": cid, "object": kind, "created": created, "model": self.model}
                event["choices"] = [choice]
                yield f"data: {_compact(event)}\n\n".encode()
                sent += 1
            if usage is not None:
                event = {"id": cid, "object": kind, "created": created, "model": self.model}
                event.update(choices=[], usage=usage)
                yield f"data: {_compact(event)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.disconnects += 1
            raise
        finally:
            self.in_flight -= 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--role", default="both", choices=["prefill", "decode", "both"])
    parser.add_argument("--ttft", type=float, default=0.0)
    parser.add_argument("--itl", type=float, default=0.0)
    args = parser.parse_args()
    import uvicorn

    engine = FakeEngine(args.model, args.role)
    engine.port, engine.ttft, engine.itl = args.port, args.ttft, args.itl
    uvicorn.run(engine.app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
