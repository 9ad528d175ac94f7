"""What a request may not steer on the engine server: its own chat template (only with
--trust-request-chat-template), the engine's request ids (a client id names the response only),
and the event loop (a huge prompt is tokenized on a thread while /health still answers)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.engine_server import NAME, Server, expect_error, start_server

pytestmark = pytest.mark.slow  # a server process each

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
CHAT = [{"role": "user", "content": "pass the baton"}]


@pytest.fixture(scope="module")
def trusting(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server that renders requests' chat templates and takes bodies of up to 10 MiB."""
    s = start_server(model, tmp_path_factory.mktemp("trusting"), "--trust-request-chat-template")
    try:
        yield s
    finally:
        s.stop()


def _chat(url: str, **extra: object) -> httpx.Response:
    body = {"model": NAME, "messages": CHAT, "max_tokens": 2, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_a_request_chat_template_needs_the_flag(server: Server, trusting: Server) -> None:
    """Off by default: a chat_template in the request is a 400 naming the flag (the openai
    client sees BadRequestError); with the flag it is rendered."""
    error = expect_error(_chat(server.url, chat_template=TEMPLATE), 400)
    assert error["param"] == "chat_template"
    assert "--trust-request-chat-template" in error["message"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=NAME, messages=CHAT, max_tokens=2, extra_body={"chat_template": TEMPLATE}
        )
    assert _chat(server.url).status_code == 200  # the model's own template is fine
    rendered = httpx.post(
        f"{trusting.url}/tokenize",
        json={"prompt": "[user]pass the baton", "add_special_tokens": False},
    ).json()["count"]
    r = _chat(trusting.url, chat_template=TEMPLATE)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == rendered


def test_documents_reach_the_template(trusting: Server) -> None:
    """vLLM's `documents` (a retrieval-augmented request's) are rendered by the template
    beside the messages: the prompt is the one the template makes of both."""
    template = "{% for d in documents or [] %}<{{ d.title }}:{{ d.text }}>{% endfor %}" + TEMPLATE
    documents = [{"title": "relay", "text": "four legs"}, {"title": "baton", "text": "hollow"}]
    rendered = httpx.post(
        f"{trusting.url}/tokenize",
        json={"prompt": "<relay:four legs><baton:hollow>[user]pass the baton",
              "add_special_tokens": False},
    ).json()["count"]  # fmt: skip
    r = _chat(trusting.url, chat_template=template, documents=documents)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == rendered
    without = _chat(trusting.url, chat_template=template).json()["usage"]["prompt_tokens"]
    assert without < rendered


def test_client_request_ids_name_responses_only(server: Server) -> None:
    """Concurrent requests under one client request_id (in the body, or the X-Request-Id header
    that wins over it, as in vLLM) all succeed, each answered under the client's id."""

    def ask(i: int) -> httpx.Response:
        body = {"model": NAME, "prompt": f"relay {i}", "max_tokens": 8, "ignore_eos": True,
                "request_id": "same", "n": 1 + i % 2}  # fmt: skip
        headers = {"x-request-id": "from-header"} if i % 3 == 0 else {}
        return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(6)))
    for i, r in enumerate(answers):
        assert r.status_code == 200, r.text
        assert r.json()["id"] == ("cmpl-from-header" if i % 3 == 0 else "cmpl-same")


def test_a_huge_tokenize_does_not_block_the_event_loop(trusting: Server) -> None:
    """A ~4 MB prompt takes the tokenizer a second or more; meanwhile /health keeps answering
    within a fraction of that (it waited for the whole tokenize when it ran on the loop)."""
    prompt = "the relay passes the baton in the marked zone. " * 85_000
    took: list[float] = []

    def tokenize() -> None:
        start = time.perf_counter()
        r = httpx.post(f"{trusting.url}/tokenize", json={"prompt": prompt}, timeout=120)
        assert r.status_code == 200 and r.json()["count"] > 500_000
        took.append(time.perf_counter() - start)

    worker = threading.Thread(target=tokenize)
    with httpx.Client(timeout=60) as client:
        client.get(f"{trusting.url}/health")  # the connection is open before the clock starts
        worker.start()
        slowest = 0.0
        while worker.is_alive():
            start = time.perf_counter()
            assert client.get(f"{trusting.url}/health").status_code == 200
            slowest = max(slowest, time.perf_counter() - start)
            time.sleep(0.02)
    worker.join()
    assert took and took[0] > 0.5, took  # long enough to have blocked
    assert slowest < took[0] / 3, (slowest, took)
