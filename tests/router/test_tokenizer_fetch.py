"""The router reads an engine's whole tokenizer however the bytes arrive: a real aiohttp server
sends a large description in pieces with pauses between them (SmolLM2's is several MB; one
`StreamReader.read(n)` returned only what had arrived and the router failed on cut JSON)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from baton.router.tokenizers import TOKENIZER_PATH, read_limited
from tests.support.ports import free_port

BODY = json.dumps({"tokenizer_json": "x" * (3 << 20), "special_tokens": {}}).encode()


async def _serve_in_pieces(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    for start in range(0, len(BODY), 256 << 10):
        await response.write(BODY[start : start + (256 << 10)])
        await asyncio.sleep(0.01)  # the reader sees a partial body on every pause
    await response.write_eof()
    return response


async def _fetch(limit: int) -> bytes:
    app = web.Application()
    app.router.add_get(TOKENIZER_PATH, _serve_in_pieces)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}{TOKENIZER_PATH}") as response,
        ):
            return await read_limited(response.content, limit)
    finally:
        await runner.cleanup()


def test_the_whole_body_arrives() -> None:
    assert asyncio.run(_fetch(64 << 20)) == BODY


def test_a_body_past_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="larger than"):
        asyncio.run(_fetch(1 << 20))
