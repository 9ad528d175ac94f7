"""The router's block hashes are the engine's, and its salts keep tenants apart.

For completions and chat prompts of every test model, with and without `cache_salt`, the router
tokenizes the prompt with the tokenizer the engine serves it (`/baton/tokenizer`), chains the
hashes itself, and finds every one of them among the blocks the engine's KV events say it
stored (read with a decoder written from vLLM's format). Salted and unsalted prompts share no
block. A router that salts per tenant keeps tenants' prefix caches apart (the engine's hit
counter)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from baton.engine.models.tiny import ARCHITECTURES
from baton.router.config import RouterConfig
from baton.router.discovery import Endpoint
from baton.router.prompts import Prompt
from baton.router.tokenizers import TOKENIZER_PATH, prompt_token_ids
from baton.tokenizer import Tokenizer
from tests.router.harness import RouterServer
from tests.support.engine_server import NAME, Server, start_server, stop_all
from tests.support.ports import free_port
from tests.support.thread_server import scrape
from tests.support.vllm_kv_events import Subscriber, apply

pytestmark = pytest.mark.slow

BS = 16
TEXT = "The relay team passed the baton at every corner of the long track, again and again. " * 3
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": TEXT}),
    ("/v1/completions", {"prompt": TEXT, "add_special_tokens": False}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": TEXT}, {"role": "user", "content": "Go?"}]},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": TEXT}, {"type": "text", "text": "Why?"}],
                },
                {"role": "assistant", "content": None, "name": None},
                {"role": "user", "content": "And?"},
            ]
        },
    ),
    (  # the last message left open (`continue_final_message`)
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": TEXT},
                {"role": "assistant", "content": "The baton is"},
            ],
            "continue_final_message": True,
        },
    ),
]


class Engine:
    def __init__(self, model: Path, tmp: Path) -> None:
        self.port, self.replay_port = free_port(), free_port()
        config = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{self.port}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
        }
        self.server: Server = start_server(
            model, tmp, "--block-size", str(BS), "--kv-events-config", json.dumps(config)
        )


@pytest.fixture(scope="module")
def engines(
    tiny_model: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Engine]]:
    models = {arch: Path(tiny_model(arch)) for arch in ARCHITECTURES}
    with ThreadPoolExecutor(len(models)) as pool:
        made = dict(
            zip(
                models,
                pool.map(lambda m: Engine(m, tmp_path_factory.mktemp("hashes")), models.values()),
                strict=True,
            )
        )
    try:
        yield made
    finally:
        stop_all(e.server for e in made.values())


def _stored(engine: Engine) -> set[int]:
    """Every block hash the engine's events stored so far (replayed from its buffer)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sub = Subscriber(ctx, engine.port, engine.replay_port, b"")
    try:
        stored: set[int] = set()
        for _, payload in sub.replay(0):
            apply(stored, payload, BS)
        return stored
    finally:
        sub.close()
        ctx.term()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_routers_hashes_are_the_engines(engines: dict[str, Engine], arch: str) -> None:
    engine = engines[arch]
    url = engine.server.url
    tokenizer = Tokenizer.from_wire(httpx.get(url + TOKENIZER_PATH, timeout=10).json())
    for route, body in BODIES:
        chains = []
        for salt in (None, f"tenant-{arch}"):
            request = {**body, "model": NAME, "max_tokens": 1, "return_token_ids": True}
            if salt is not None:
                request["cache_salt"] = salt
            answer = httpx.post(url + route, json=request, timeout=60)
            assert answer.status_code == 200, answer.text
            ids = prompt_token_ids(tokenizer, route, request)
            got = answer.json()  # vLLM's places: the choice (completions), the top (chat)
            engine_ids = got.get("prompt_token_ids") or got["choices"][0]["prompt_token_ids"]
            assert ids == engine_ids, (route, body)
            hashes = Prompt(tokens=ids, cache_salt=salt).exact_hashes(BS)
            assert len(hashes) >= 2
            chains.append(hashes)
        stored = _stored(engine)
        unsalted, salted = chains
        assert set(unsalted) <= stored and set(salted) <= stored, (arch, route)
        assert not set(unsalted) & set(salted)


def test_truncated_prompts_are_left_to_the_engine(engines: dict[str, Engine]) -> None:
    """With `truncate_prompt_tokens` the engine keeps the prompt's last k tokens (k its own
    max_model_len for -1): the router does not claim to know them, whatever the prompt."""
    engine = engines[ARCHITECTURES[0]]
    tokenizer = Tokenizer.from_wire(
        httpx.get(engine.server.url + TOKENIZER_PATH, timeout=10).json()
    )
    for route, body in [*BODIES, ("/v1/completions", {"prompt": [5, 6, 7, 8]})]:
        assert prompt_token_ids(tokenizer, route, body) is not None
        truncated = {**body, "truncate_prompt_tokens": 2}
        assert prompt_token_ids(tokenizer, route, truncated) is None, (route, body)


@pytest.mark.parametrize("source", ["api-key", "header"])
def test_tenants_never_hit_each_others_blocks(engines: dict[str, Engine], source: str) -> None:
    """Through a router that salts per tenant (from the API key, or a tenant header, replacing
    any salt the client sent): tenant B's copy of tenant A's prompt hits none of A's blocks,
    and A's repeat hits its own (the engine's vllm:prefix_cache_hits)."""
    engine = engines["llama"].server
    config = RouterConfig(health_interval=0.2, cache_salt_from=source)  # type: ignore[arg-type]
    router = RouterServer([Endpoint(engine.url, "both")], config)
    router.start()
    try:
        router.wait_ready(available=1)
        prompt = f"[{source}] " + TEXT

        def send(tenant: str, **fields: Any) -> float:
            headers = (
                {"Authorization": f"Bearer key-{tenant}"}
                if source == "api-key"
                else {"x-tenant-id": tenant}
            )
            before = scrape(engine.url, "vllm:prefix_cache_hits_total")
            body = {"model": NAME, "prompt": prompt, "max_tokens": 1, **fields}
            r = httpx.post(f"{router.url}/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            return scrape(engine.url, "vllm:prefix_cache_hits_total") - before

        assert send("a") == 0
        assert send("b") == 0  # the same prompt, another tenant: a miss
        assert send("a") > 0  # a's own blocks
        # A client's own salt is replaced by its tenant's: b hits b's blocks, in no new scope.
        assert send("b", cache_salt="anything") > 0
    finally:
        router.stop()
