"""The router's decisions for one request: which model, which engines may answer it, which one
goes first (policy, session affinity), and how it is sent on (directly, or through the
prefill→decode hand-off of `handoff`).

`Router` owns the engine set, the prefix index, the health monitor and the upstream client;
`app` turns HTTP requests into calls on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import aiohttp
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from baton import tracing
from baton.errors import APIError
from baton.http_server import ClientGone, cancel_on_disconnect
from baton.roles import ROLES, Role
from baton.router.cache_view import CacheView
from baton.router.config import RouterConfig
from baton.router.discovery import Discovery, Endpoint
from baton.router.engines import (
    AGGREGATED_ROLES,
    DECODE_ROLES,
    PREFILL_ROLES,
    EngineSet,
    EngineState,
)
from baton.router.handoff import Handoff
from baton.router.health import HealthMonitor
from baton.router.hold import Holds
from baton.router.kv_index import KVIndex
from baton.router.kv_subscriber import Subscriptions, source_of
from baton.router.metrics import RouterMetrics
from baton.router.migration import RESUME_TOKEN_IDS, Migrator, StreamLog
from baton.router.policies import Policy, RoundRobin, make_policy, session_choice
from baton.router.prefix_index import PrefixIndex
from baton.router.prompts import Prompt, prompt_of
from baton.router.proxy import Pick, Upstream
from baton.router.tokenizers import (
    MAX_TOKENIZER_BYTES,
    TOKENIZER_PATH,
    Tokenizers,
    prompt_token_ids,
    read_limited,
)

logger = logging.getLogger(__name__)

# The client's trace context goes on as it came when the router does not trace (a proxy that
# takes no part in a W3C trace passes it through); its own span's replaces it when it does.
_FORWARDED_HEADERS = ("x-request-id", "authorization", *tracing.TRACE_HEADERS)

# Says which engine's KV blocks a request reads or keeps: only the router's own hand-off may
# set it (a client's would make an engine connect where the client says, or hand the client
# engine coordinates), and an engine's answer never shows it to a client.
KV_TRANSFER_PARAMS = "kv_transfer_params"
# What only the router sends engines: the KV hand-off's params, and a migrated stream's tokens.
_ROUTER_FIELDS = (KV_TRANSFER_PARAMS, RESUME_TOKEN_IDS)
RETURN_TOKEN_IDS = "return_token_ids"
CACHE_SALT = "cache_salt"
TOKENIZER_TIMEOUT = 30.0  # seconds to fetch a model's tokenizer from an engine


def client_body(raw: bytes, body: dict[str, Any]) -> bytes:
    """`raw` without the fields only the router may set (popped from `body` too); unchanged,
    not re-encoded, when it has none."""
    if not any(f in body for f in _ROUTER_FIELDS):
        return raw
    for field in _ROUTER_FIELDS:
        body.pop(field, None)
    return json.dumps(body).encode()


def with_token_ids(raw: bytes, body: dict[str, Any]) -> bytes:
    """`raw` asking the engine for each event's token ids (`body` too). The field is appended
    to the bytes, not re-encoded: a repeated key's last value is the one JSON readers keep."""
    body[RETURN_TOKEN_IDS] = True
    raw = raw.rstrip()
    if len(body) == 1 or not raw.endswith(b"}"):
        return json.dumps(body).encode()
    return raw[:-1] + b',"return_token_ids":true}'


@dataclass
class Routed:
    """One generation request as the router reads it."""

    route: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]  # the parsed JSON body
    raw: bytes  # the body as it came (less any kv_transfer_params), sent on as it is
    model: str
    stream: bool
    session_id: str | None  # the x-session-id header
    prompt: Prompt
    headers: dict[str, str]  # what goes to the engines
    started: float  # time.perf_counter() at arrival
    request: Request
    # A stream that may move to another engine if its engine fails (one prompt, n=1); its
    # engines send token ids, which the client sees only if it asked for them.
    migratable: bool = False
    client_token_ids: bool = False


class Router:
    """Everything the router knows and decides; one per process."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self.engines = EngineSet(on_up=self._on_engine_up)
        self.index = PrefixIndex(config.prefix_index_blocks)  # approximate
        self.kv_index = KVIndex()  # exact, from the engines' KV events
        self.subscriptions = Subscriptions(self.kv_index)
        self.view = CacheView(
            self.index, self.kv_index, self.subscriptions, config.prefix_block_chars
        )
        self.tokenizers = Tokenizers(self._fetch_tokenizer)
        self.metrics = RouterMetrics(self.engines)
        # Requests of models with no engine up wait here; these models are known from the start.
        self.holds = Holds(
            config.hold_timeout, config.hold_queue_size, self.metrics, config.served_models
        )
        self.health = HealthMonitor(
            self.engines,
            self.session,
            config,
            self.metrics,
            lambda s: self.view.forget(s.url),
            self.on_health,
        )
        self.upstream = Upstream(self.health, self.metrics, config)
        weight = config.prefix_load_weight
        self.prefill_policy = make_policy(config.prefill_policy, self.view, weight)
        self.decode_policy = make_policy(config.decode_policy, self.view, weight)
        self._any_policy = RoundRobin()
        self.handoff = Handoff(self)
        self.tracer = tracing.Tracer(config.otlp_traces_endpoint, "baton-router", "router")
        self._discovery: asyncio.Task[None] | None = None
        self.discovered = asyncio.Event()  # discovery delivered its first set

    # -- lifecycle --

    def session(self) -> aiohttp.ClientSession:
        """The health probes', scrapes' and tokenizer fetches' connection pool to the engines,
        made on first use (on the router's loop); requests go over `upstream.streams`."""
        if self._session is None:
            config = self.config
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=config.max_connections, limit_per_host=0),
                # connect: waiting for a pooled connection included; sock_read: between bytes
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=config.request_timeout,
                    sock_connect=config.connect_timeout,
                    sock_read=config.request_timeout,
                ),
                auto_decompress=False,  # bodies pass through as the engines sent them
                trust_env=False,
            )
        return self._session

    def start(self, discovery: Discovery) -> None:
        """Starts following `discovery` (and health-checking what it finds)."""
        self._discovery = asyncio.create_task(discovery.run(self.on_discovery), name="discovery")

    async def close(self) -> None:
        self.holds.close()
        if self._discovery is not None:
            self._discovery.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._discovery
        await self.health.close()
        await self.subscriptions.close()
        await self.tokenizers.close()
        self.upstream.streams.close()
        if self._session is not None:
            await self._session.close()
        await asyncio.to_thread(self.tracer.shutdown)  # the spans still queued

    def on_discovery(self, endpoints: frozenset[Endpoint]) -> None:
        for endpoint in endpoints:
            if endpoint.model is not None:
                self.holds.know(endpoint.model)  # still served once its engines are gone
        added, removed = self.engines.update(endpoints)
        for state in removed:
            logger.info("engine %s (%s) removed", state.url, state.role)
            self.health.unwatch(state)
            self.subscriptions.stop(state.url)
            self.view.forget(state.url)
        for state in added:
            logger.info("engine %s (%s) added", state.url, state.role)
            self.health.watch(state)
        self.discovered.set()

    def _on_engine_up(self, state: EngineState) -> None:
        """An engine passed its health check after failing (or for the first time): a decode
        or aggregated one can answer its models' held requests."""
        for model in state.models:
            self.holds.know(model)
            if state.role in DECODE_ROLES:
                self.holds.release(model)

    def on_health(self, state: EngineState, health: dict[str, Any]) -> None:
        """An engine answered /health: follow its KV events as it advertises them (unless
        the router runs with the approximate index only), and fetch its model's tokenizer."""
        if self.config.prefix_index != "events":
            return
        self.subscriptions.sync(state.url, health)
        if source_of(state.url, health) is not None:
            for model in state.models:
                self.tokenizers.want(model, state.url)

    async def _fetch_tokenizer(self, engine: str) -> bytes:
        timeout = aiohttp.ClientTimeout(total=TOKENIZER_TIMEOUT)
        auth = self.health.auth
        async with self.session().get(
            engine + TOKENIZER_PATH, timeout=timeout, headers=auth.headers, ssl=auth.ssl
        ) as response:
            if response.status != 200:
                raise ValueError(f"{TOKENIZER_PATH} answered {response.status}")
            return await read_limited(response.content, MAX_TOKENIZER_BYTES)

    def ready(self) -> bool:
        """Discovery has answered and every known engine has been checked once."""
        return self.discovered.is_set() and all(s.checked for s in self.engines)

    # -- reading a request --

    async def body(self, request: Request) -> tuple[bytes, Any]:
        """The request's body as it came and as JSON; refused with 413 past `max_body_bytes` (by
        its Content-Length, before reading, or as it arrives: the router holds whole bodies in
        memory), with 400 when it is not JSON."""
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise _too_large(limit)
        except ClientDisconnect:
            raise ClientGone() from None
        try:
            return bytes(body), json.loads(body)
        except ValueError as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None

    async def read(self, route: str, request: Request) -> Routed:
        raw, body = await self.body(request)
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        headers = {"content-type": "application/json"}
        headers |= {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}
        # One id for every engine of the request (and so one response id when a stream moves).
        headers.setdefault("x-request-id", uuid.uuid4().hex)
        trace = tracing.current()
        headers |= trace.headers()  # the engines' spans are children of the router's
        raw = client_body(raw, body)
        model = self.resolve_model(body.get("model"))
        trace.set(tracing.SpanAttributes.GEN_AI_RESPONSE_MODEL, model)
        raw = self._salt(request, raw, body)
        prompt = prompt_of(body)
        salt = body.get(CACHE_SALT)
        prompt.cache_salt = salt if isinstance(salt, str) else None
        if prompt.token_ids is not None:
            prompt.tokens = prompt.token_ids  # ids need no tokenizer
        elif (tokenizer := self.tokenizers.get(model)) is not None and self._counts_tokens(model):
            prompt.tokens = prompt_token_ids(tokenizer, route, body)
        stream = bool(body.get("stream", False))
        client_token_ids = bool(body.get(RETURN_TOKEN_IDS, False))
        migratable = (
            stream
            and self.config.migration_limit > 0
            and prompt.num_prompts == 1
            and body.get("n") in (None, 1)
        )
        if migratable:
            raw = with_token_ids(raw, body)
        return Routed(
            route=route,
            body=body,
            raw=raw,
            model=model,
            stream=stream,
            session_id=request.headers.get("x-session-id")
            if self.config.session_affinity
            else None,
            prompt=prompt,
            headers=headers,
            started=time.perf_counter(),
            request=request,
            migratable=migratable,
            client_token_ids=client_token_ids,
        )

    def _counts_tokens(self, model: str) -> bool:
        """Whether a decision on `model`'s requests reads exact token counts: a prefix-aware
        policy, or the hand-off's (whether to skip the prefill step)."""
        aware = "prefix-aware" in (self.config.prefill_policy, self.config.decode_policy)
        return aware or self.has_disaggregated(model)

    def _salt(self, request: Request, raw: bytes, body: dict[str, Any]) -> bytes:
        """`raw` with the tenant's `cache_salt` when the router sets it (`cache_salt_from`):
        a digest of the request's API key or tenant header, replacing any the client sent, so
        that tenants never share prefix-cache blocks (nor learn from their time to first token
        what another tenant's prompts were). No key or header: no salt, a shared cache."""
        source = self.config.cache_salt_from
        if source == "client":
            return raw
        if source == "api-key":
            auth = request.headers.get("authorization", "")
            tenant = auth[7:] if auth[:7].lower() == "bearer " else ""
        else:
            tenant = request.headers.get(self.config.cache_salt_header, "")
        salt = hashlib.sha256(b"baton-tenant\0" + tenant.encode()).hexdigest()[:32]
        if not tenant:
            if CACHE_SALT not in body:
                return raw
            body.pop(CACHE_SALT)
        else:
            body[CACHE_SALT] = salt
        return json.dumps(body).encode()

    def resolve_model(self, model: object) -> str:
        """The model a request names; the only one served when it names none. Served: the
        models of the known engines, `served_models`, and every model discovery has shown."""
        if isinstance(model, str) and (self.engines.serves(model) or self.holds.knows(model)):
            return model  # the common case, without listing every model
        served = sorted({*self.engines.models(), *self.holds.models()})
        if model is None:
            if len(served) == 1:
                return served[0]
            raise APIError(400, f"model is required; this router serves {served}", "model")
        if not isinstance(model, str) or model not in served:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return model

    # -- choosing engines --

    def choose(
        self,
        routed: Routed,
        roles: Collection[Role],
        policy: Policy,
        exclude: Collection[str] = (),
        pair: EngineState | None = None,
        prefer_pairs_with: Collection[EngineState] = (),
    ) -> EngineState | None:
        """The engine `policy` (or the session) picks among the available ones of `roles`
        (those that can hand KV to or from `pair`, when given); among those, only the ones that
        can pair with one of `prefer_pairs_with`, when there are any."""
        candidates = [
            s
            for s in self.engines.available(routed.model, roles)
            if s.url not in exclude and (pair is None or s.can_pair_with(pair))
        ]
        if prefer_pairs_with:
            paired = [s for s in candidates if any(s.can_pair_with(o) for o in prefer_pairs_with)]
            candidates = paired or candidates
        if not candidates:
            return None
        if routed.session_id is not None:
            return session_choice(candidates, routed.session_id)
        return policy.choose(candidates, routed.prompt)

    def picker(
        self,
        routed: Routed,
        roles: Collection[Role],
        policy: Policy,
        first: EngineState | None = None,
        pair: EngineState | None = None,
    ) -> Pick:
        """The `Pick` for `Upstream.send`: `first` if given, then the policy's choices (among
        the engines that can pair with `pair`). Each pick is remembered in the approximate
        index: the engine will hold the prompt's blocks."""

        def pick(tried: set[str]) -> EngineState | None:
            engine: EngineState | None = first
            if engine is None or engine.url in tried:
                engine = self.choose(routed, roles, policy, tried, pair)
            if engine is not None:
                self.view.record(engine.url, routed.prompt)
            return engine

        return pick

    def has_disaggregated(self, model: str) -> bool:
        """The model has prefill or decode engines (so requests go through the hand-off)."""
        return bool(self.engines.of_model(model, ("prefill", "decode")))

    # -- sending on --

    async def generate(self, routed: Routed) -> Response:
        """Answers a completions or chat completions request; held first while no engine that
        can answer it (decode or aggregated) is up. A missing prefill pool is the hand-off's
        matter (`on_no_prefill`), not a reason to hold."""
        if self.config.hold_timeout > 0 and not self.engines.any_up(routed.model, DECODE_ROLES):
            await cancel_on_disconnect(routed.request, self.holds.hold(routed.model))
        if self.has_disaggregated(routed.model):
            return await self.handoff.serve(routed)
        return await self.forward(
            routed,
            AGGREGATED_ROLES,
            self.decode_policy,
            routed.raw,
            none_available=f"no healthy engine serves the model `{routed.model}`",
        )

    async def forward(
        self,
        routed: Routed,
        roles: Collection[Role],
        policy: Policy,
        content: bytes,
        *,
        none_available: str,
        first: EngineState | None = None,
        pair: EngineState | None = None,
        extra_headers: dict[str, str] | None = None,
    ) -> Response:
        """Sends `content` to an engine of `roles` (retrying elsewhere before the first byte)
        and answers the client with what comes back."""
        send = self.upstream.send(
            routed.route,
            self.picker(routed, roles, policy, first, pair),
            content,
            routed.headers,
            stream=routed.stream,
            none_available=none_available,
        )
        if routed.stream:
            answer = await send
        else:  # a client that leaves stops the engine's work (the engine aborts on close)
            answer = await cancel_on_disconnect(routed.request, send)
        tracing.current().set(tracing.SpanAttributes.ENGINE, answer.engine.url)
        headers = {"x-request-id": routed.headers["x-request-id"], **(extra_headers or {})}
        if not (routed.migratable and answer.stream is not None):
            return self.upstream.response(answer, routed.route, routed.started, headers)
        # A stream that moves goes on among the engines of `roles` (a decode engine computes
        # the prompt itself, without a new hand-off).
        return self.upstream.response(
            answer,
            routed.route,
            routed.started,
            headers,
            Migrator(self, routed, roles, policy),
            StreamLog(strip_token_ids=not routed.client_token_ids),
        )

    async def forward_any(self, route: str, request: Request) -> Response:
        """/tokenize and /detokenize: any available engine of the model."""
        started = time.perf_counter()
        raw, body = await self.body(request)
        if isinstance(body, dict):
            raw = client_body(raw, body)
        model = self.resolve_model(body.get("model") if isinstance(body, dict) else None)

        def pick(tried: set[str]) -> EngineState | None:
            candidates = [s for s in self.engines.available(model, ROLES) if s.url not in tried]
            return self._any_policy.choose(candidates, Prompt()) if candidates else None

        answer = await self.upstream.send(
            route,
            pick,
            raw,
            {"content-type": "application/json"},
            stream=False,
            none_available=f"no healthy engine serves the model `{model}`",
        )
        return self.upstream.response(answer, route, started)

    def models(self) -> dict[str, Any]:
        """GET /v1/models: every model of every known engine, and the models served with no
        engine now (a pool at zero: a request wakes it)."""
        cards: dict[str, dict[str, Any]] = {
            m: {"id": m, "object": "model", "owned_by": "baton"} for m in self.holds.models()
        }
        for state in self.engines:
            for model in state.models:
                card = state.cards.get(model)
                if model not in cards or (card is not None and "root" not in cards[model]):
                    cards[model] = card or {"id": model, "object": "model", "owned_by": "baton"}
        return {"object": "list", "data": [cards[m] for m in sorted(cards)]}

    def _pairs_with(self, state: EngineState, now: float) -> list[str]:
        """The available engines `state` could hand KV to or take it from, by URL."""
        others = DECODE_ROLES if state.role == "prefill" else PREFILL_ROLES
        return [
            o.url
            for model in state.models
            for o in self.engines.of_model(model, others)
            if o.available(now) and o.can_pair_with(state)
        ]

    def describe_models(self) -> dict[str, dict[str, Any]]:
        """GET /engines, per disaggregated model: whether a compatible prefill/decode pair of
        available engines exists, and how many."""
        out = {}
        for model in self.engines.disaggregated_models():
            pairs = self.engines.compatible_pairs(model)
            out[model] = {"compatible_pairs": pairs, "compatible_pair": pairs > 0}
        return out

    def describe(self) -> list[dict[str, Any]]:
        """GET /engines: what the router knows of each engine (for people and tests)."""
        now = time.monotonic()
        return [
            {
                "url": s.url,
                "role": s.role,
                "models": list(s.models),
                "healthy": s.healthy,
                "available": s.available(now),
                "in_flight": s.in_flight,
                "tensor_parallel_size": s.tensor_parallel_size,
                "fingerprint": s.fingerprint,
                "compatibility": s.compatibility,
                "pairs_with": self._pairs_with(s, now),
                "load": s.load(),
                "consecutive_failures": s.consecutive_failures,
                "prefix_index_blocks": self.index.num_blocks(s.url),
                "kv_index": {
                    "mode": self.view.mode(s.url),
                    "events": self.subscriptions.describe(s.url),
                },
            }
            for s in self.engines
        ]


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes")
