"""The OpenAI-compatible routes' logic over one engine: admission and the drain, prompts,
completions and chat completions (whole or streamed as server-sent events), and the tokenizer
routes. `server.build_app` wires an `EngineServer` into FastAPI.

Request ids: a client's `request_id` (or `X-Request-Id` header, which wins, as in vLLM) names
the response only. Every engine request gets an id of its own, the response id with a random
suffix: the engine keys blocks, leases and aborts by it, and a client id reused while the first
request's blocks are still leased would otherwise write one prompt's KV into another's.

Large prompts are tokenized (and chat templates rendered) on a small thread pool, so that a
10 MiB body does not stall every other stream and /health for the seconds it takes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, Response
from prometheus_client import Gauge
from pydantic import BaseModel

from baton import tracing
from baton.block_hash import HASH_SCHEME
from baton.engine.api import constraints, tools
from baton.engine.api import protocol as p
from baton.engine.api import responses as r
from baton.engine.api.metrics import EngineMetrics, cache_config_info
from baton.engine.api.streams import EventStream, PromptStream, cleanup_for, collect, merge
from baton.engine.api.tools import ChoiceParser, ToolConfig
from baton.engine.async_llm import AsyncLLM, check_resume_token_ids
from baton.engine.detokenizer import IncrementalDetokenizer
from baton.engine.outputs import RequestOutput
from baton.engine.processor import check_prompt_token_ids
from baton.engine.protocol import EngineStats
from baton.engine.sampling_params import SamplingParams, StructuredOutputsParams
from baton.engine.structured.backend import GrammarCompiler
from baton.errors import APIError
from baton.kv_transfer.keyring import KeyRing
from baton.kv_transfer.params import DO_REMOTE_DECODE, DO_REMOTE_PREFILL, KVTransferParams

logger = logging.getLogger(__name__)

# Prompts of more characters than this are tokenized off the event loop: below it, the hop to a
# thread costs more than the tokenization (about 1 MB/s here, so ~16 ms at the bound).
OFF_LOOP_CHARS = 16 << 10
_TOKENIZE_THREADS = 2


Render = Callable[[str, list[int]], str]  # an event for its text and token ids


def _text_event(
    cache: dict[int, r.TextEvents | None],
    index: int,
    text: str,
    token_ids: list[int],
    render: Callable[[int], Render],
    with_ids: bool,
) -> str:
    """The event of choice `index` that carries `text` (and `token_ids`, `with_ids`) and
    nothing else that changes from one such event to the next: `render(index)`'s, made through
    the choice's `TextEvents` (kept in `cache`, made on the choice's first such event)."""
    if index not in cache:
        cache[index] = r.TextEvents.make(render(index), with_ids)
    events = cache[index]
    return render(index)(text, token_ids) if events is None else events(text, token_ids)


def _finish_reason(delta: r.Delta) -> str | None:
    if delta.finish_reason == "abort":  # never shown to a client as a finish reason
        raise APIError(500, "the engine aborted the request")
    return delta.finish_reason


class EngineServer:
    """The routes' logic over one engine; `build_app` wires it into FastAPI."""

    def __init__(
        self,
        llm: AsyncLLM,
        *,
        served_model_name: str | None,  # None: the model folder's name
        max_waiting_requests: int | None,  # 429 once the engine has this many waiting
        engine_label: str,  # the `engine` label of every metric
        trust_request_chat_template: bool = False,  # a request's own chat_template is rendered
        prompt_tokens_details: bool = True,  # usage says how many prompt tokens were cached
        tool_config: ToolConfig | None = None,  # tool calling and reasoning parsers
        log_stats: bool = True,  # False: no per-request metrics (vLLM's --disable-log-stats)
        otlp_traces_endpoint: str | None = None,  # where spans go (None: nowhere, no cost)
        sampling_defaults: Mapping[str, Any] | None = None,  # the model's generation config's
    ) -> None:
        self.tool_config = tool_config or ToolConfig()
        self.llm = llm
        self.sampling_defaults = dict(sampling_defaults or {})
        self.prompt_tokens_details = prompt_tokens_details
        self._validator: constraints.ConstraintValidator | None = None  # made on first use
        self._validator_error: str | None = None
        self._validator_lock = threading.Lock()
        self.max_waiting_requests = max_waiting_requests
        self.tokenizer = llm.tokenizer
        self._instance = uuid.uuid4().hex  # this process, in /health's kv_events
        self.trust_request_chat_template = trust_request_chat_template
        self._tokenize_pool = ThreadPoolExecutor(_TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self.model_name = served_model_name or llm.model_path.name
        kv = llm.args.kv_transfer
        self.role = kv.role if kv is not None else "both"
        self.kv_role = kv.role if kv is not None else None  # None: no KV connector
        # Checks the signature of every lease a decode request names before the core sees it.
        self.keys = KeyRing.load(kv.secret_file) if kv is not None else None
        self.metrics = EngineMetrics(
            lambda: llm.stats,
            self.model_name,
            engine_label,
            self.role,
            llm.kv_transport,
            max_model_len=llm.max_model_len,
            cache_config=cache_config_info(llm.args, llm.num_blocks),
            log_stats=log_stats,
        )
        llm.add_stats_listener(self.metrics.observe_step)
        self.tracer = tracing.Tracer(otlp_traces_endpoint, "baton-engine", self.role)
        # Engine request id -> the trace of its HTTP request, while it runs: the core reports
        # a KV pull's end by engine request id.
        self._traces: dict[str, tracing.RequestTrace] = {}
        llm.add_stats_listener(self._on_kv_transfers)
        self.tensor_parallel_size = llm.args.tensor_parallel_size
        # The parallel layout as an info metric, as baton:engine_info gives role and transport.
        Gauge(
            "baton:engine_parallel_info",
            "The engine's parallel layout (value 1).",
            ["model_name", "engine", "tensor_parallel_size"],
            registry=self.metrics.registry,
        ).labels(self.model_name, engine_label, str(self.tensor_parallel_size)).set(1)
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def decode_token(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _logprob_tokens(self, req: p.CompletionRequest | p.ChatCompletionRequest) -> r.DecodeToken:
        """How the request's logprobs show a token: its text, or with vLLM's
        `return_tokens_as_token_ids` its id."""
        return r.token_id_str if req.return_tokens_as_token_ids else self.decode_token

    # -- the request's constraints --

    def _validate(self, constraint: StructuredOutputsParams, field: str) -> None:
        """Checks `constraint` with the grammar compiler, made on first use (on the tokenize
        pool, like every check: it indexes the whole vocabulary, 0.3-0.9 s for 49k tokens,
        which a server that never sees a constraint need not pay). A tokenizer the grammar
        library cannot read makes every constraint a 400 that says so."""
        with self._validator_lock:
            if self._validator is None and self._validator_error is None:
                try:
                    self._validator = GrammarCompiler.from_config(
                        self.tokenizer,
                        self.llm.vocab_size,
                        self.llm.eos_token_ids,
                        self.llm.args.structured_outputs_config,
                    )
                except ValueError as e:
                    self._validator_error = str(e)
        if self._validator_error is not None:
            raise APIError(
                400,
                "structured outputs are not available for this model: the grammar library "
                f"cannot read its tokenizer ({self._validator_error})",
                field,
            )
        assert self._validator is not None
        constraints.validate_constraint(self._validator, constraint, field)

    async def _finish_params(
        self, req: p.CompletionRequest | p.ChatCompletionRequest, params: list[SamplingParams]
    ) -> None:
        """What needs the model: bad words as token ids, token ids within the vocabulary, and
        the structured-output constraint the params carry (the request's own, or the chat
        path's forced tool call) checked by the grammar compiler once, off the loop (a large
        schema takes a while); each a 400 naming its field. The same for every prompt."""
        bad_words = constraints.bad_words_token_ids(
            req.bad_words, lambda text: self._encode(text, add_special_tokens=False)
        )
        for sp in params:
            sp.bad_words_token_ids = [list(w) for w in bad_words]
        constraints.check_token_ids(params[0], self.llm.vocab_size)  # a request has a prompt
        constraint = params[0].structured_outputs
        if constraint is None:
            return
        own = req.structured_outputs_params()
        ours = own is not None and replace(constraint, after_token_ids=None) == own
        field = (req.constraint_field() if ours else None) or "tools"  # else a forced tool's
        await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, self._validate, constraint, field
        )

    # -- admission and the drain --

    def _admit(self) -> Callable[[], None]:
        """Checks a generation request may start; returns the call that ends its tracking."""
        if self.llm.dead_error is not None:
            raise APIError(503, f"the engine is dead: {self.llm.dead_error}")
        if self.draining:
            raise APIError(503, "the server is shutting down")
        bound = self.max_waiting_requests
        if bound is not None and self.llm.stats.num_waiting >= bound:
            raise APIError(
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

    def health(self) -> dict[str, Any]:
        fp = self.llm.fingerprint
        return {
            "status": "ok",
            "model": self.model_name,
            "role": self.role,
            "kv_transport": self.llm.kv_transport,
            "kv_port": self.llm.kv_ports[0] if self.llm.kv_ports else None,
            "kv_ports": self.llm.kv_ports,
            "tensor_parallel_size": self.tensor_parallel_size,
            # Engines hand KV over only between equal fingerprints; the router pairs by it.
            "fingerprint": fp.digest if fp is not None else None,
            "compatibility": msgspec.to_builtins(fp) if fp is not None else None,
            # What the router needs to hash prompts as this engine's prefix cache does.
            "block_size": self.llm.args.block_size,
            "hash": HASH_SCHEME,
            "kv_events": self._kv_events(),
        }

    def _kv_events(self) -> dict[str, Any] | None:
        """Where this engine publishes its KV cache events (the endpoints as configured: a
        subscriber keeps the port and uses the engine's own host); None when it does not."""
        events = self.llm.args.kv_events_config
        if events is None or not events.enabled:
            return None
        return {
            "endpoint": events.endpoint,
            "replay_endpoint": events.replay_endpoint,
            "topic": events.topic,
            "block_size": self.llm.args.block_size,
            "hash": HASH_SCHEME,
            # A new process numbers its batches from 0 again: a subscriber that sees another
            # instance starts over rather than wait for the next batch to tell it.
            "instance": self._instance,
        }

    def _kv_transfer_params(
        self, params: dict[str, Any] | None, num_prompts: int, n: int
    ) -> KVTransferParams | None:
        """The request's `kv_transfer_params`, parsed (the one place they are) and, for a
        decode request, their signature checked; or a 400."""
        try:
            parsed = KVTransferParams.parse(params)
            if parsed is not None:
                parsed.check_engine(self.kv_role, self.tensor_parallel_size)
        except ValueError as e:
            raise APIError(400, str(e), "kv_transfer_params") from None
        handing_off = parsed is not None and (parsed.do_remote_decode or parsed.do_remote_prefill)
        if handing_off and (num_prompts > 1 or n > 1):
            raise APIError(
                400,
                "kv_transfer_params hand off one prompt's KV: use one prompt and n=1",
                "kv_transfer_params",
            )
        if parsed is not None and parsed.remote is not None:
            assert self.keys is not None  # check_engine: only an engine with a connector
            why = parsed.remote.unverified(self.keys)
            if why is not None:
                raise APIError(400, why, "kv_transfer_params")
        return parsed

    # -- prompts --

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: only the batch call lets go of the GIL while it works (a
        # thread that holds it stalls the event loop all the same); it is as fast on one text.
        (encoding,) = self.tokenizer.backend.encode_batch(
            [text], add_special_tokens=add_special_tokens
        )
        return list(encoding.ids)

    async def _tokenize_prompt(
        self, prompt: str | list[int], add_special_tokens: bool
    ) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and token ids."""
        if not isinstance(prompt, str):
            return None, prompt

        if len(prompt) <= OFF_LOOP_CHARS:
            return prompt, self._encode(prompt, add_special_tokens)
        loop = asyncio.get_running_loop()
        return prompt, await loop.run_in_executor(
            self._tokenize_pool, self._encode, prompt, add_special_tokens
        )

    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as
        the model takes); more than the model takes is a 400, with vLLM's words."""
        if keep is None:
            return ids
        limit = self.llm.max_model_len
        if keep > limit:
            raise APIError(
                400,
                f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({limit})."
                " Please, select a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        keep = limit if keep == -1 else keep
        return ids[-keep:] if len(ids) > keep else ids

    def _check_prompt(self, ids: list[int], param: str) -> None:
        try:
            check_prompt_token_ids(ids, self.llm.max_model_len, self.llm.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param) from None

    def _check_chat_template(self, template: str | None) -> None:
        """A request's own template is code the server runs (in a sandbox, but its loops and
        output size are the client's): refused unless the operator trusts the clients."""
        if template is not None and not self.trust_request_chat_template:
            raise APIError(
                400,
                "a chat_template in the request is refused: this server does not run "
                "--trust-request-chat-template",
                "chat_template",
            )

    async def _render_chat(
        self,
        messages: list[p.ChatMessage],
        add_generation_prompt: bool,
        template: str | None,
        tool_dicts: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,  # the request's chat_template_kwargs
        continue_final_message: bool = False,
        documents: list[dict[str, str]] | None = None,
    ) -> tuple[str, list[int]]:
        """The rendered prompt's text and token ids."""
        self._check_chat_template(template)
        conversation = [m.to_template() for m in messages]
        size = sum(len(str(m.get("content", ""))) for m in conversation)
        size += len(str(tool_dicts or "")) + len(str(template_kwargs or ""))
        size += len(str(documents or ""))

        def render() -> tuple[str, list[int]]:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=template,
                tools=tool_dicts,
                documents=documents,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
            return text, self._encode(text, add_special_tokens=False)

        try:
            # A request's own template (trusted, but its loops are its own) always goes off it.
            if size > OFF_LOOP_CHARS or template is not None:
                return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, render)
            return render()
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception as e:  # a template that fails to render
            raise APIError(400, f"the chat template failed: {e}", "messages") from None

    # -- completions --

    async def completions(
        self, req: p.CompletionRequest, header_request_id: str | None = None
    ) -> Response:
        req.check()
        self._check_model(req.model)
        client_id = header_request_id or req.request_id
        inputs = []
        for prompt in req.prompts():
            text, ids = await self._tokenize_prompt(prompt, req.add_special_tokens)
            if (kept := self._truncate(ids, req.truncate_prompt_tokens)) is not ids:
                text, ids = None, kept  # the text is the kept tokens' (for an echo)
            max_tokens = p.resolve_max_tokens(
                req.max_tokens, 16, len(ids), self.llm.max_model_len, "prompt"
            )
            self._check_prompt(ids, "prompt")
            if text is None and req.echo:  # only once the ids are known to be in the vocabulary
                text = self.tokenizer.decode(ids)
            params = req.to_sampling_params(max_tokens, self.sampling_defaults)
            self._check_resume(req, ids, params)
            inputs.append(((text, ids), params))
        await self._finish_params(req, [params for _, params in inputs])
        response_id, created = f"cmpl-{client_id or p.random_id()}", int(time.time())
        decode = self._logprob_tokens(req)
        streams, release = self._open(
            req, [_internal_id(f"{response_id}-{i}") for i in range(len(inputs))], inputs
        )
        if not req.stream:
            return await self._respond(
                streams,
                release,
                lambda outs: r.completion_response(
                    req,
                    response_id,
                    created,
                    self.model_name,
                    outs,
                    decode,
                    self.prompt_tokens_details,
                ),
            )
        holdback = r.stop_holdback(req.stop_list())
        cursors = [[r.SampleCursor(holdback) for _ in range(req.n)] for _ in streams]
        if req.resume_token_ids is not None:  # one prompt, n=1
            (_, ids), params = inputs[0]
            offset = 0
            if req.logprobs is not None:  # where the first stream's logprobs left off
                shown = (ids if req.echo else []) + req.resume_token_ids
                offset = sum(len(decode(t)) for t in shown)
            resumed_text = self._resumed_text(ids, req.resume_token_ids, params)
            cursors[0][0].resume(len(req.resume_token_ids), resumed_text, offset)
        echo_only = req.echo_only()
        # Whether an event that carries only text (and token ids) may come from its choice's
        # `TextEvents`.
        spliced = req.logprobs is None and not req.continuous_usage()
        with_ids = bool(req.return_token_ids)
        text_events: dict[int, r.TextEvents | None] = {}

        def chunk(choices: list[r.CompletionChoice], **extra: Any) -> str:
            return r.sse(
                r.CompletionChunk(
                    id=response_id, created=created, model=self.model_name, choices=choices, **extra
                )
            )

        def text_chunk(index: int) -> Render:
            """What an event that carries only text (and token ids) is (see `spliced`)."""
            usage = self._chunk_usage(req, 0, 0)  # none, or null: the same on each

            def render(text: str, token_ids: list[int]) -> str:
                choice: dict[str, Any] = dict(
                    index=index, text=text, logprobs=None, finish_reason=None, stop_reason=None
                )
                if with_ids:
                    choice["token_ids"] = token_ids
                return chunk([r.CompletionChoice(**choice)], **usage)

            return render

        def chunks(i: int, out: RequestOutput) -> Iterator[str]:
            for sample in out.outputs:
                cursor = cursors[i][sample.index]
                started = cursor.started
                delta = cursor.advance(sample)
                if delta is None:
                    continue
                text, ids = delta.text, delta.token_ids
                entries: list[Any] = list(delta.logprobs or [])
                if echo_only:  # the prompt is the answer: its one step's token is discarded
                    text, ids, entries = "", [], []
                if req.echo and not started:
                    text = (out.prompt or "") + text
                    ids = out.prompt_token_ids + ids
                    entries = r.prompt_entries(out) + entries
                if (
                    spliced
                    and delta.finish_reason is None
                    and delta.stop_reason is None
                    and (started if with_ids else text)  # the first has the prompt's ids
                ):
                    index = i * req.n + sample.index
                    yield _text_event(
                        text_events, index, text, delta.token_ids, text_chunk, with_ids
                    )
                    continue
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
                    choice["logprobs"], cursor.text_offset = r.completion_logprobs(
                        ids, entries, req.logprobs, cursor.text_offset, decode
                    )
                if req.return_token_ids:
                    choice["token_ids"] = delta.token_ids
                    if not started:
                        choice["prompt_token_ids"] = out.prompt_token_ids
                usage = self._chunk_usage(req, len(out.prompt_token_ids), cursor.tokens_sent)
                yield chunk([r.CompletionChoice(**choice)], **usage)

        return self._stream(streams, release, [], chunks, chunk, req.include_usage())

    # -- chat completions --

    async def chat_completions(
        self, req: p.ChatCompletionRequest, header_request_id: str | None = None
    ) -> Response:
        req.check()
        self._check_model(req.model)
        client_id = header_request_id or req.request_id
        prompt, ids = await self._render_chat(
            req.messages,
            p.generation_prompt(req),
            req.chat_template,
            req.template_tools(),
            req.chat_template_kwargs,
            req.continue_final_message,
            req.documents,
        )
        mode = tools.output_mode(req, self.tool_config, prompt)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        ids = self._truncate(ids, req.truncate_prompt_tokens)
        max_tokens = p.resolve_max_tokens(
            req.requested_max_tokens(),
            self.sampling_defaults.get("max_tokens"),
            len(ids),
            self.llm.max_model_len,
            "messages",
            param,
        )
        self._check_prompt(ids, "messages")
        response_id, created = f"chatcmpl-{client_id or p.random_id()}", int(time.time())
        decode = self._logprob_tokens(req)
        # A token's own bytes, unless the logprobs show ids (their bytes are the id's text).
        token_bytes = None if req.return_tokens_as_token_ids else self.tokenizer.token_bytes
        params = req.to_sampling_params(max_tokens, self.sampling_defaults)
        self._check_resume(req, ids, params)
        params.structured_outputs = tools.constraint(
            req, mode, req.structured_outputs_params(), self._think_end_ids(mode)
        )
        await self._finish_params(req, [params])  # checks a forced tool's schema too
        if mode.tool_parser is not None and mode.tool_parser.needs_special_tokens:
            params.skip_special_tokens = False  # the parser reads its marker tokens (vLLM)
        inputs = [((None, ids), params)]
        streams, release = self._open(req, [_internal_id(response_id)], inputs)
        if not req.stream:
            return await self._respond(
                streams,
                release,
                lambda outs: r.chat_response(
                    req,
                    response_id,
                    created,
                    self.model_name,
                    outs[0],
                    decode,
                    mode=mode,
                    prompt_tokens_details=self.prompt_tokens_details,
                    token_bytes=token_bytes,
                ),
            )
        cursors = [r.SampleCursor(r.stop_holdback(req.stop_list())) for _ in range(req.n)]
        parsers = [ChoiceParser(mode) for _ in range(req.n)]
        texts = [""] * req.n
        plain = mode.tool_parser is None and mode.reasoning is None
        # Whether an event that carries only text (and token ids) may come from its choice's
        # `TextEvents`.
        spliced = plain and not req.logprobs and not req.continuous_usage()
        with_ids = bool(req.return_token_ids)
        text_events: dict[int, r.TextEvents | None] = {}

        def chunk(choices: list[r.ChatStreamChoice], **extra: Any) -> str:
            return r.sse(
                r.ChatCompletionChunk(
                    id=response_id, created=created, model=self.model_name, choices=choices, **extra
                )
            )

        def text_chunk(index: int) -> Render:
            """What an event that carries only text (and token ids) is (see `spliced`)."""
            usage = self._chunk_usage(req, len(ids), 0)  # none, or null: the same on each

            def render(text: str, token_ids: list[int]) -> str:
                choice: dict[str, Any] = dict(
                    index=index,
                    delta=r.DeltaMessage(content=text),
                    logprobs=None,
                    finish_reason=None,
                    stop_reason=None,
                )
                if with_ids:
                    choice["token_ids"] = token_ids
                return chunk([r.ChatStreamChoice(**choice)], **usage)

            return render

        resumed = req.resume_token_ids
        if resumed is not None:  # n=1: go on from what the first stream sent
            resumed_text = self._resumed_text(ids, resumed, params)
            cursors[0].resume(len(resumed), resumed_text)
            texts[0] = resumed_text[: cursors[0].text_sent]
            if not plain:  # its state as if it had parsed that; what it says went out before
                parsers[0].advance(texts[0], final=False)

        def chunks(_: int, out: RequestOutput) -> Iterator[str]:
            for sample in out.outputs:
                delta = cursors[sample.index].advance(sample)
                if delta is None:
                    continue
                finish = _finish_reason(delta)
                if spliced and delta.text and finish is None and delta.stop_reason is None:
                    text, token_ids = delta.text, delta.token_ids
                    yield _text_event(
                        text_events, sample.index, text, token_ids, text_chunk, with_ids
                    )
                    continue
                if plain:
                    message = r.DeltaMessage(content=delta.text) if delta.text else r.DeltaMessage()
                    shown = bool(delta.text)
                else:
                    parser = parsers[sample.index]
                    texts[sample.index] += delta.text
                    parsed = parser.advance(texts[sample.index], final=finish is not None)
                    if not req.include_reasoning:
                        parsed.reasoning = ""  # parsed, so that the content is told apart
                    message, shown = r.delta_message(parsed), bool(parsed)
                    finish = tools.finish_reason(mode, parser.called, finish)
                if not (shown or finish or req.logprobs or req.return_token_ids):
                    continue  # tokens whose text is held back: nothing to show yet
                choice: dict[str, Any] = {
                    "index": sample.index,
                    "delta": message,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": delta.stop_reason,
                }
                if req.logprobs:
                    choice["logprobs"] = r.chat_logprobs(
                        delta.token_ids,
                        delta.logprobs or [],
                        req.top_logprobs or 0,
                        decode,
                        token_bytes,
                    )
                if req.return_token_ids:
                    choice["token_ids"] = delta.token_ids
                usage = self._chunk_usage(req, len(ids), cursors[sample.index].tokens_sent)
                yield chunk([r.ChatStreamChoice(**choice)], **usage)

        # OpenAI opens each choice with the role and empty content (once: a resumed answer's
        # client has it).
        head = []
        for index in range(req.n if resumed is None else 0):
            role = r.DeltaMessage(role=req.response_role(), content="")
            choice = r.ChatStreamChoice(index=index, delta=role, logprobs=None, finish_reason=None)
            first = {"prompt_token_ids": ids} if req.return_token_ids and index == 0 else {}
            head.append(chunk([choice], **self._chunk_usage(req, len(ids), 0), **first))
        if resumed is None and (echoed := req.echoed_text()):  # then vLLM's echo, each choice
            for index in range(req.n):
                delta = r.DeltaMessage(content=echoed)
                choice = r.ChatStreamChoice(
                    index=index, delta=delta, logprobs=None, finish_reason=None
                )
                head.append(chunk([choice], **self._chunk_usage(req, len(ids), 0)))
        return self._stream(streams, release, head, chunks, chunk, req.include_usage())

    def _think_end_ids(self, mode: tools.OutputMode) -> list[int] | None:
        """`</think>`'s token ids, where the answer may reason (a grammar starts after them)."""
        if mode.reasoning is None or mode.think_state == "closed":
            return None
        return self.tokenizer.encode(mode.reasoning.end, add_special_tokens=False)

    # -- both --

    def _check_resume(
        self,
        req: p.CompletionRequest | p.ChatCompletionRequest,
        prompt_ids: list[int],
        params: SamplingParams,
    ) -> None:
        """A resumed answer's token ids against the vocabulary, the prompt and the params."""
        if req.resume_token_ids is None:
            return
        try:
            check_resume_token_ids(
                req.resume_token_ids,
                len(prompt_ids),
                params,
                self.llm.max_model_len,
                self.llm.vocab_size,
            )
        except ValueError as e:
            raise APIError(400, str(e), "resume_token_ids") from None

    def _resumed_text(
        self, prompt_ids: list[int], resume_token_ids: list[int], params: SamplingParams
    ) -> str:
        """The text of a resumed answer's tokens as the engine that produced them had it (an
        unfinished character's bytes held back): what its stream had sent is all of it but
        the stop-string holdback."""
        detok = IncrementalDetokenizer(
            self.tokenizer, [], params.skip_special_tokens, 0, prompt_ids
        )
        detok.resume(resume_token_ids)
        return detok.text

    @staticmethod
    def _chunk_usage(
        req: p.CompletionRequest | p.ChatCompletionRequest, prompt_tokens: int, completion: int
    ) -> dict[str, Any]:
        """A chunk's usage field: none unless asked for; with `include_usage` null (OpenAI's:
        the usage comes in a last chunk of its own), and with `continuous_usage_stats` the
        chunk's prompt and its sample's tokens so far (vLLM's)."""
        if not req.include_usage():
            return {}
        if not req.continuous_usage():
            return {"usage": None}
        return {"usage": r.running_usage(prompt_tokens, completion)}

    def _open(
        self,
        req: p.CompletionRequest | p.ChatCompletionRequest,
        request_ids: list[str],
        inputs: Sequence[tuple[tuple[str | None, list[int]], SamplingParams]],
    ) -> tuple[list[PromptStream], Callable[[], None]]:
        """Admits the request and starts one engine request per prompt; the call returned ends
        the admission's tracking."""
        resumed = req.resume_token_ids
        handing_off = any(
            (req.kv_transfer_params or {}).get(k) for k in (DO_REMOTE_DECODE, DO_REMOTE_PREFILL)
        )
        if resumed is not None and handing_off:
            raise APIError(
                400,
                "resume_token_ids cannot be combined with kv_transfer_params that hand off KV: "
                "a resumed answer computes its prompt and output on this engine",
                "resume_token_ids",
            )
        kv_params = self._kv_transfer_params(req.kv_transfer_params, len(inputs), req.n)
        trace = tracing.current()
        if kv_params is not None:  # a prefill engine's lease names the client's request
            kv_params = msgspec.structs.replace(kv_params, client_request_id=trace.request_id)
        release = self._admit()
        streams = [
            PromptStream(
                self.llm,
                self.metrics,
                rid,
                prompt,
                params,
                req.priority,
                kv_params,
                resumed,
                req.cache_salt,
            )
            for rid, (prompt, params) in zip(request_ids, inputs, strict=True)
        ]
        prompt_tokens = sum(len(ids) for (_, ids), _ in inputs)
        return streams, self._traced(trace, request_ids, prompt_tokens, streams, release)

    def _traced(
        self,
        trace: tracing.RequestTrace,
        request_ids: list[str],
        prompt_tokens: int,
        streams: list[PromptStream],
        release: Callable[[], None],
    ) -> Callable[[], None]:
        """`release`, noting first on the request's trace how it went (its end line and span
        show it): tokens, time in queue, and a prefill request's lease. Until then its engine
        requests are known to `_on_kv_transfers`."""
        a = tracing.SpanAttributes
        trace.set(a.GEN_AI_RESPONSE_MODEL, self.model_name)
        trace.set(a.GEN_AI_USAGE_PROMPT_TOKENS, prompt_tokens)
        for rid in request_ids:
            self._traces[rid] = trace

        def end() -> None:
            for rid in request_ids:
                self._traces.pop(rid, None)
            outs = [s.last for s in streams if s.last is not None]
            completion = sum(len(o.token_ids) for out in outs for o in out.outputs)
            trace.set(a.GEN_AI_USAGE_COMPLETION_TOKENS, completion)
            queued = [out.queue_time for out in outs if out.queue_time is not None]
            if queued:
                trace.set(a.GEN_AI_LATENCY_TIME_IN_QUEUE, max(queued))
            for out in outs:
                lease = out.kv_transfer_params  # a prefill answer: where its KV waits
                if lease:
                    trace.set(a.KV_LEASE, str(lease.get("remote_request_id")))
                    trace.set(a.KV_LEASED_BLOCKS, len(lease.get("remote_block_ids") or ()))
            release()

        return end

    def _on_kv_transfers(self, stats: EngineStats) -> None:
        """Each KV pull that ended: a line under its request's id, and a `kv_pull` span under
        its request's span, ending now (the core reports a pull within a step of its end)."""
        a = tracing.SpanAttributes
        for result in stats.kv_transfers:
            trace = self._traces.get(result.req_id)
            if trace is None:
                continue
            outcome = "ok" if result.ok else result.reason
            pull: dict[str, tracing.AttributeValue] = {
                a.KV_BYTES: result.num_bytes,
                a.KV_SECONDS: result.seconds,
                a.KV_OUTCOME: outcome,
            }
            for key, value in pull.items():
                trace.set(key, value)
            end = time.time()
            trace.child("kv_pull", end - result.seconds, end, pull)
            tracing.log_for(
                trace.request_id, logger, logging.INFO, "KV pulled: %d bytes in %.3f s (%s)",
                result.num_bytes, result.seconds, result.error or "ok",
            )  # fmt: skip

    async def _respond(
        self,
        streams: list[PromptStream],
        release: Callable[[], None],
        body: Callable[[list[RequestOutput]], BaseModel],
    ) -> Response:
        """A non-streaming answer: waits for every prompt, then answers at once."""
        try:
            outputs = await collect(streams)
            for out in outputs:
                if any(s.finish_reason == "abort" for s in out.outputs):
                    raise APIError(500, "the engine aborted the request")
            return JSONResponse(body(outputs).model_dump(mode="json"))
        finally:
            await cleanup_for(streams, release)()

    def _stream(
        self,
        streams: list[PromptStream],
        release: Callable[[], None],
        head: list[str],
        chunks: Callable[[int, RequestOutput], Iterator[str]],
        chunk: Callable[..., str],
        include_usage: bool,
    ) -> Response:
        """A streaming answer: `head`, the chunks of each snapshot, `chunk`'s usage chunk if asked
        for, `[DONE]`. An error after the headers went out is an error event, then `[DONE]`."""
        cleanup = cleanup_for(streams, release)
        unsent: list[str] = []  # the events `direct` made of a snapshot but could not write

        async def events() -> AsyncGenerator[str, None]:
            try:
                for event in head:
                    yield event
                if len(streams) == 1:  # most answers: without `merge`'s layer per token
                    while (out := await streams[0].next()) is not None:
                        if unsent:  # made of this snapshot: nothing of it is left to make
                            yield "".join(unsent)
                            unsent.clear()
                        for event in chunks(0, out):
                            yield event
                else:
                    async for i, out in merge(streams):
                        for event in chunks(i, out):
                            yield event
                if include_usage:
                    usage = r.usage_of(
                        [s.last for s in streams if s.last is not None], self.prompt_tokens_details
                    )
                    yield chunk([], usage=usage)
                yield r.DONE
            except APIError as e:
                yield e.sse().decode()
                yield r.DONE
            finally:
                await cleanup()

        def direct(write: Callable[[bytes], bool]) -> None:
            """One prompt's tokens written by the engine's output loop as they come, not by
            `events` (a task switch and its generators a token); the last through `events`."""

            def handle(out: RequestOutput) -> bool:
                body = "".join(chunks(0, out))
                if body and not write(body.encode()):  # paused for a slow client, or gone
                    unsent.append(body)  # `events` sends it, waiting for the client
                    return False
                return True

            streams[0].direct(handle)

        return EventStream(events(), cleanup, direct if len(streams) == 1 else None)

    # -- tokenizer routes --

    async def tokenize(self, req: p.TokenizeRequest) -> r.TokenizeResponse:
        req.check()
        self._check_model(req.model)
        if req.messages is not None:
            _, ids = await self._render_chat(
                req.messages,
                p.generation_prompt(req),
                None,
                continue_final_message=req.continue_final_message,
            )
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            _, ids = await self._tokenize_prompt(req.prompt or "", add_special)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return r.TokenizeResponse(
            count=len(ids), max_model_len=self.llm.max_model_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, req: p.DetokenizeRequest) -> r.DetokenizeResponse:
        self._check_model(req.model)
        vocab = self.llm.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token ids outside [0, {vocab}): {bad[:5]}", "tokens")
        return r.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def models(self) -> r.ModelList:
        card = r.ModelCard(
            id=self.model_name, root=str(self.llm.model_path), max_model_len=self.llm.max_model_len
        )
        return r.ModelList(data=[card])


def _internal_id(response_id: str) -> str:
    """The engine's id for one prompt of a response: unique whatever id the client sent."""
    return f"{response_id}-{p.random_id()}"
