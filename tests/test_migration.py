"""Mid-stream migration end to end: `baton serve` with 1 prefill + 2 decode engines of the tiny
model; the decode engine serving a stream is killed (SIGKILL, its whole process group) at chosen
points of the stream: after a few tokens, between the bytes of a multi-byte character, inside a
stop string. Every client stream completes with exactly the answer one engine alone gives
(greedy), streamed and whole, for completions and chat. `baton serve` restarts a killed engine,
so each case starts with two decode engines again."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.support.procs import engine_core, state
from tests.support.thread_server import scrape
from tests.test_serve import ENGINE_FLAGS, Serve, _engine_pid, needs_roles

pytestmark = [pytest.mark.slow, needs_roles]

MAX_TOKENS = 48
PROMPTS = {
    "/v1/completions": "A relay runner hands the baton over in the zone and",
    "/v1/chat/completions": "Tell me about relay races.",
}


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    model = Path(tiny_model("llama"))
    s = Serve(
        tmp_path_factory.mktemp("migration") / "serve.log",
        "--model", str(model), "--served-model-name", "tiny", "--prefill", "1", "--decode", "2",
        "--policy", "round-robin", "--eject-seconds", "1", "--shutdown-timeout", "1",
        "--restart-max-seconds", "1",  # the tests kill engines many times: no growing waits
        *ENGINE_FLAGS,
    )  # fmt: skip
    s.tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))  # type: ignore[attr-defined]
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.log()


def _body(route: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, **extra}  # fmt: skip
    if route == "/v1/completions":
        body["prompt"] = PROMPTS[route]
    else:
        body["messages"] = [{"role": "user", "content": PROMPTS[route]}]
    return body


def _all_healthy(stack: Serve, timeout: float = 90) -> list[str]:
    """Waits until both decode engines are available again (serve restarts a killed one);
    returns their URLs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        decodes = [e for e in stack.engines() if e["role"] == "decode"]
        if len(decodes) == 2 and all(e["available"] and _up(e["url"]) for e in decodes):
            return [e["url"] for e in decodes]
        time.sleep(0.3)
    raise AssertionError(f"the decode engines are not back:\n{stack.log()}")


def _up(url: str) -> bool:
    """The engine answers its own /health (the router's view may lag a kill by a check)."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _single(stack: Serve, route: str, body: dict[str, Any]) -> tuple[str, list[int]]:
    """The answer of one decode engine alone (it computes the prompt itself)."""
    url = _all_healthy(stack)[0]
    r = httpx.post(f"{url}{route}", json={**body, "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if route == "/v1/completions" else choice["message"]["content"]
    return text, choice["token_ids"]


def _kill(url: str) -> None:
    """Stops the engine at once (no more bytes leave it), then kills its process group."""
    pid = _engine_pid(url)
    os.kill(pid, signal.SIGSTOP)
    os.killpg(pid, signal.SIGKILL)


class _Paced:
    """The decode engines' EngineCores, stopped (SIGSTOP) and run only in bursts of a few
    milliseconds (at the lowest priority, so that a loaded machine does not stretch them): an
    answer cannot end before the test kills its engine, and the kill lands near its point.
    Leaving the block lets every core that is still there run again."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.cores = [engine_core(_engine_pid(url)) for url in urls]
        for core in self.cores:  # the test's own timing comes first on a loaded machine
            os.setpriority(os.PRIO_PROCESS, core.pid, 19)

    def __enter__(self) -> _Paced:
        self._signal(signal.SIGSTOP)
        try:
            self._wait_stopped()
        except BaseException:  # no core may stay stopped for the tests after this one
            self._signal(signal.SIGCONT)
            raise
        return self

    def _wait_stopped(self, timeout: float = 10) -> None:
        """A stop takes effect when the core next runs, which at the lowest priority on a
        loaded machine can be a while (a restarted core still starting up is runnable)."""
        deadline = time.monotonic() + timeout
        while (states := [state(core.pid) for core in self.cores]) != ["T"] * len(self.cores):
            assert time.monotonic() < deadline, (self.urls, self.cores, states)
            time.sleep(0.01)

    def __exit__(self, *_: object) -> None:
        self._signal(signal.SIGCONT)

    def burst(self, progress: Callable[[], int] = lambda: 0) -> None:
        """Lets the cores run a moment, then waits until what they made has reached the
        client (`progress`, the client's count of something, stops changing)."""
        self._signal(signal.SIGCONT)
        time.sleep(0.001)
        self._signal(signal.SIGSTOP)
        seen = -1
        while (now := progress()) != seen:
            seen = now
            time.sleep(0.05)

    def _signal(self, sig: signal.Signals) -> None:
        for core in self.cores:  # a killed one is skipped, never another that took its id
            core.signal(sig)


def _stream_killed(
    stack: Serve,
    route: str,
    body: dict[str, Any],
    kill_after: int,
    kill: Callable[[str], None] = _kill,
    kill_at: Callable[[int], bool] = lambda _: False,
) -> tuple[str, list[int], list[dict[str, Any]], int]:
    """Streams through the router and `kill`s the serving decode engine once the client has
    `kill_after` tokens, or sooner, between bursts, at a count `kill_at` accepts; returns the
    whole text, token ids and chunks the client got, and how many tokens it had at the kill
    (where the stream moved)."""
    body = {**body, "stream": True, "return_token_ids": True}
    chunks: list[dict[str, Any]] = []
    engine: list[str] = []

    def read() -> None:
        with httpx.stream("POST", f"{stack.url}{route}", json=body, timeout=60) as r:
            assert r.status_code == 200
            engine.append(r.headers["x-baton-engine"])
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))

    def ids() -> list[int]:
        return [
            t
            for c in list(chunks)
            for ch in c.get("choices", ())
            for t in ch.get("token_ids") or []
        ]

    reader = threading.Thread(target=read)
    with _Paced(_all_healthy(stack)) as paced:
        reader.start()
        while len(ids()) < kill_after and not kill_at(len(ids())) and reader.is_alive():
            paced.burst(lambda: len(ids()))
        assert len(ids()) >= kill_after or kill_at(len(ids())), "the stream ended first"
        assert engine[0] in paced.urls, (engine, paced.urls)
        killed_at = len(ids())
        kill(engine[0])
    reader.join(60)
    assert not reader.is_alive()
    text = ""
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, ids(), chunks, killed_at


def _migrations(stack: Serve) -> float:
    return scrape(stack.url, "baton:router_migrations_total", outcome="resumed")


@pytest.mark.parametrize(
    ("route", "kill_after"),
    [("/v1/completions", 1), ("/v1/completions", 17), ("/v1/chat/completions", 5)],
)
def test_a_killed_decode_engine_does_not_end_the_stream(
    stack: Serve, route: str, kill_after: int
) -> None:
    body = _body(route, max_tokens=200)  # longer than any burst of the paced engine
    want_text, want_ids = _single(stack, route, body)
    for _attempt in range(3):
        before = _migrations(stack)
        text, ids, chunks, _ = _stream_killed(stack, route, body, kill_after)
        if "baton_migrations" in chunks[-1] or ids != want_ids:
            break
        # The whole answer had left the engine before the kill (on a loaded machine the client
        # can lag the paced bursts): the premise did not hold, so the kill is tried again.
    assert ids == want_ids and text == want_text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["baton_migrations"] == 1
    assert _migrations(stack) == before + 1


def test_a_drained_engine_hands_its_stream_over(stack: Serve) -> None:
    """SIGTERM to the decode engine serving a stream, whose shutdown timeout (1 s) is shorter
    than the stream: at the timeout the engine says in-band that it is going away (a 503 error
    event), and the stream goes on from the other decode engine, whole."""
    route = "/v1/chat/completions"
    body = _body(route, max_tokens=200)
    want_text, want_ids = _single(stack, route, body)

    def drain(url: str) -> None:
        os.kill(_engine_pid(url), signal.SIGTERM)
        time.sleep(3)  # its core stopped: the stream outlasts the timeout, then the 503 event

    text, ids, chunks, _ = _stream_killed(stack, route, body, 6, drain)
    assert ids == want_ids and text == want_text
    assert chunks[-1]["baton_migrations"] == 1
    assert "shutting down (drain timeout)" in stack.log()


def test_a_cut_between_the_bytes_of_a_character(stack: Serve) -> None:
    """The kill lands where the tokens so far end inside a multi-byte character: the text the
    client gets is still the single engine's, character for character."""
    route = "/v1/completions"
    body = _body(route, prompt="接力赛跑的运动员在交接区传递接力棒，然后", max_tokens=200)
    want_text, want_ids = _single(stack, route, body)
    tokenizer: Tokenizer = stack.tokenizer  # type: ignore[attr-defined]
    inside = [
        k for k in range(1, len(want_ids) - 8)
        if tokenizer.decode(want_ids[:k]).endswith("\ufffd")
    ]  # fmt: skip
    assert inside, "the answer has no character split over tokens: choose another prompt"
    points = set(inside)
    for _ in range(3):
        # Killed after the first burst that stops inside a character (a burst may run past
        # one); the last such point is the fallback.
        text, ids, chunks, killed_at = _stream_killed(
            stack, route, body, inside[-1], kill_at=lambda n: n in points
        )
        assert ids == want_ids and text == want_text
        if chunks[-1].get("baton_migrations") == 1 and killed_at in points:
            return
    raise AssertionError("no kill landed inside a character")


# In `make test-long`, alone on the machine: under `make test`'s second worker (the 30-layer
# SmolLM2 tests among its neighbours) the kill missed the 6-character window on every try in two
# runs of six, while alone and beside two busy loops it landed every time.
@pytest.mark.long
def test_a_cut_inside_a_stop_string(stack: Serve) -> None:
    """The stop string straddles the kill point: it is still found, and the answer ends
    where the single engine's does."""
    route = "/v1/chat/completions"
    body = _body(route)
    full_text, full_ids = _single(stack, route, body)
    tokenizer: Tokenizer = stack.tokenizer  # type: ignore[attr-defined]
    for cut in (10, 15, 20, 25, 30, 35):  # a burst of the paced engine may run past the stop
        at = len(tokenizer.decode(full_ids[:cut]))
        stop = full_text[at - 3 : at + 3]
        if len(stop) < 6 or full_text.find(stop) != at - 3:
            continue  # not a stop string that ends the answer there
        stopped = _body(route, stop=[stop])
        want_text, want_ids = _single(stack, route, stopped)
        assert want_text == full_text[: at - 3]
        # The token counts at which a kill lands inside the stop string; the first of them is
        # the aim (a burst may run a token or two past it and still land inside).
        inside = [
            n for n in range(len(full_ids)) if at - 3 < len(tokenizer.decode(full_ids[:n])) < at + 3
        ]
        text, ids, chunks, killed_at = _stream_killed(stack, route, stopped, inside[0])
        assert text == want_text and ids == want_ids
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        moved_at = len(tokenizer.decode(full_ids[:killed_at]))
        if chunks[-1].get("baton_migrations") == 1 and at - 3 < moved_at < at + 3:
            return
    raise AssertionError("no kill landed inside the stop string")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_whole_answer_survives_its_engine(stack: Serve, route: str) -> None:
    """Not streamed: the decode engine computing the answer is killed; the router sends the
    request again (nothing reached the client) and the client gets one answer, the single
    engine's."""
    body = _body(route, max_tokens=120)
    want_text, want_ids = _single(stack, route, body)
    # On a loaded machine the answer may be whole before the kill lands (no retry then): the
    # answer must be right every time, and one try must have been a retry.
    for _ in range(3):
        if _whole_answer_retried(stack, route, body, want_text, want_ids):
            return
    raise AssertionError("no kill landed while the engine computed the answer")


def _whole_answer_retried(
    stack: Serve, route: str, body: dict[str, Any], want_text: str, want_ids: list[int]
) -> bool:
    urls = _all_healthy(stack)
    answer: dict[str, Any] = {}

    def ask() -> None:
        r = httpx.post(f"{stack.url}{route}", json={**body, "return_token_ids": True}, timeout=90)
        answer["status"], answer["body"] = r.status_code, r.json()

    retries = scrape(stack.url, "baton:router_retries_total")
    asker = threading.Thread(target=ask)
    with _Paced(urls) as paced:
        asker.start()
        busy = None
        for _ in range(200):
            paced.burst()
            busy = next((e["url"] for e in stack.engines()
                         if e["url"] in urls and e["in_flight"]), None)  # fmt: skip
            if busy is not None:
                break
        assert busy is not None, "no decode engine took the request"
        for _ in range(3):  # it computes a little of the answer
            paced.burst()
        _kill(busy)
    asker.join(90)
    assert answer["status"] == 200, answer
    choice = answer["body"]["choices"][0]
    text = choice["text"] if route == "/v1/completions" else choice["message"]["content"]
    assert choice["token_ids"] == want_ids and text == want_text
    return scrape(stack.url, "baton:router_retries_total") == retries + 1
