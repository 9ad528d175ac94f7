"""The router's copy of each model's tokenizer, and a request's prompt as the engine's token ids.

An engine serves its tokenizer (`GET /baton/tokenizer`: the tokenizer.json, named special
tokens and chat templates it uses); the router fetches it once per model, in the background,
from the first engine that publishes KV events (only those need exact hashes). Until it has
one, and for any request it cannot render exactly as the engine would (a request's own chat
template, content it does not know), the prompt has no token ids and routing falls back to the
approximate index.

Chat messages are normalised as the engine's `ChatMessage.to_template` does: None fields
dropped, text parts joined with newlines, tool-call arguments parsed from their JSON text.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from baton.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_PATH = "/baton/tokenizer"
MAX_TOKENIZER_BYTES = 64 << 20


async def read_limited(content: aiohttp.StreamReader, limit: int) -> bytes:
    """The whole body, or ValueError past `limit` bytes. (`StreamReader.read(n)` returns what
    has arrived, at most n bytes: one call cut a large tokenizer short.)"""
    body = bytearray()
    async for chunk in content.iter_chunked(1 << 20):
        body += chunk
        if len(body) > limit:
            raise ValueError(f"the tokenizer is larger than {limit} bytes")
    return bytes(body)


Fetch = Callable[[str], Awaitable[bytes]]  # engine URL -> its tokenizer's JSON


class Tokenizers:
    """Model -> its tokenizer, fetched from one of its engines."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._tokenizers: dict[str, Tokenizer] = {}
        self._pending: dict[str, asyncio.Task[None]] = {}

    def get(self, model: str) -> Tokenizer | None:
        return self._tokenizers.get(model)

    def want(self, model: str, engine: str) -> None:
        """Fetches `model`'s tokenizer from `engine` unless it is known or being fetched."""
        if model in self._tokenizers or model in self._pending:
            return
        task = asyncio.create_task(self._load(model, engine), name=f"tokenizer {model}")
        self._pending[model] = task

    async def _load(self, model: str, engine: str) -> None:
        try:
            data = json.loads(await self._fetch(engine))
            self._tokenizers[model] = Tokenizer.from_wire(data)
            logger.info("model %s: tokenizing prompts with %s's tokenizer", model, engine)
        except Exception as e:  # another engine may serve it; the next check asks again
            logger.warning("model %s: could not fetch the tokenizer of %s: %s", model, engine, e)
        finally:
            del self._pending[model]

    async def close(self) -> None:
        for task in list(self._pending.values()):
            task.cancel()


def prompt_token_ids(tokenizer: Tokenizer, route: str, body: dict[str, Any]) -> list[int] | None:
    """The token ids the engine will compute for `body`'s (first) prompt; None when the router
    cannot tell them exactly."""
    if body.get("truncate_prompt_tokens") is not None:
        return None  # the engine keeps the last k tokens, k by its own max_model_len for -1
    try:
        if route == "/v1/chat/completions":
            return _chat_ids(tokenizer, body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(x, int) for x in prompt):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            special = body.get("add_special_tokens", True)
            return tokenizer.encode(prompt, add_special_tokens=special is not False)
    except Exception:  # a prompt the engine will refuse with a 400; routing does not care
        return None
    return None


def _chat_ids(tokenizer: Tokenizer, body: dict[str, Any]) -> list[int] | None:
    messages = body.get("messages")
    if body.get("chat_template") is not None or not isinstance(messages, list):
        return None
    conversation = [_message(m) for m in messages]
    if any(m is None for m in conversation):
        return None
    tools, documents = body.get("tools"), body.get("documents")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(
        x is None or isinstance(x, list) for x in (tools, documents)
    ):
        return None
    continued = body.get("continue_final_message") is True  # as the engine renders it
    text = tokenizer.apply_chat_template(
        [m for m in conversation if m is not None],
        tokenize=False,
        add_generation_prompt=body.get("add_generation_prompt", True) is not False
        and not continued,
        tools=tools or None,
        documents=documents,
        continue_final_message=continued,
        **kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _message(message: Any) -> dict[str, Any] | None:
    if not isinstance(message, dict) or "role" not in message:
        return None
    out = {k: v for k, v in message.items() if v is not None}
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return None
        out["content"] = "\n".join(str(p.get("text", "")) for p in content)
    elif content is None:
        out["content"] = ""
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_call(c) for c in calls]
    return out


def _call(call: Any) -> Any:
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        function = {k: v for k, v in call["function"].items() if v is not None}
        function["arguments"] = json.loads(function.get("arguments", "{}"))
        out = {"type": "function", **{k: v for k, v in call.items() if v is not None}}
        return {**out, "function": function}
    return call
