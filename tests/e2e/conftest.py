"""Fixtures of the fault and drain suite: real `baton engine` and `baton router` processes of the
tiny model on free 127.0.0.1 ports, started in parallel once for the package, and the checks every
fault test ends with (each request ended, nothing leaked, survivors serve)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.engine_server import NAME, Server, start_all, stop_all
from tests.support.procs import Process, alive, engine_core
from tests.support.router_process import RouterProcess

BLOCK = "8"
LEASE_SECONDS = 2.0  # unclaimed leases end quickly, so a leak check needs no long wait
LOAD_TIMEOUT = 3.0  # a stalled pull fails quickly
COMMON = (
    "--block-size",
    BLOCK,
    "--num-gpu-blocks-override",
    "256",
    "--kv-lease-seconds",
    str(LEASE_SECONDS),
    "--kv-load-timeout",
    str(LOAD_TIMEOUT),
    "--shutdown-timeout",
    "20",
    # The fault peers and the canary speak TCP; `auto` would take NIXL where it is installed.
    "--kv-transport",
    "tcp",
)

# The engines of the session, by name: (role, extra flags). Survivors (p0, d0) serve every test;
# each victim is killed or drained by one test.
ENGINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "p0": ("prefill", ()),
    "d0": ("decode", ()),
    "pv_server": ("prefill", ("--max-num-seqs", "1")),
    "pv_core": ("prefill", ()),
    "dv_server": ("decode", ()),
    "dv_core": ("decode", ()),
    "d_small": ("decode", ("--num-gpu-blocks-override", "24", "--max-model-len", "128")),
    "p_drain": ("prefill", ("--kv-lease-seconds", "4")),
    "d_drain": ("decode", ()),
}


class Fleet:
    """Every engine of the session, started side by side (the 2 cores load them in parallel)."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.model, self.tmp = model, tmp
        self.servers: dict[str, Server] = {}
        self.pids: dict[str, int] = {}
        self.cores: dict[str, Process] = {}

    def __getitem__(self, name: str) -> Server:
        return self.servers[name]

    def start(self) -> None:
        flags = {name: (*COMMON, "--role", role, *extra) for name, (role, extra) in ENGINES.items()}
        self.servers = start_all(self.model, self.tmp, flags)
        self.pids = {name: s.proc.pid for name, s in self.servers.items()}
        self.cores = {n: engine_core(s.proc.pid) for n, s in self.servers.items()}

    def stop(self) -> None:
        for core in self.cores.values():  # a SIGSTOPped core must not linger
            core.signal(signal.SIGCONT)
        stop_all(self.servers.values())


class RouterProc(RouterProcess):
    """`baton router` in front of engine servers, with fast health checks; ready once built."""

    def __init__(self, log: Path, prefill: list[Server], decode: list[Server], *flags: str):
        fast = ("--health-interval", "0.2", "--health-timeout", "1", "--eject-seconds", "1")
        urls = [s.url for s in prefill], [s.url for s in decode]
        super().__init__(log, *urls, *fast, *flags)
        self.wait_ready()


# Package scope: the fleet's 18 processes end with the last test of tests/e2e instead of
# idling beside every later test of the session.
@pytest.fixture(scope="package")
def fleet(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    fleet = Fleet(Path(tiny_model("llama")), tmp)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()
    left = [p for p in fleet.pids.values() if alive(p)]
    left += [core.pid for core in fleet.cores.values() if core.running()]
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def make_router(tmp_path: Path) -> Iterator[Callable[..., RouterProc]]:
    """Returns `make(prefill, decode, *flags)`: a ready router; every one is stopped after."""
    made: list[RouterProc] = []

    def make(prefill: list[Server], decode: list[Server], *flags: str) -> RouterProc:
        made.append(RouterProc(tmp_path / f"router-{len(made)}.log", prefill, decode, *flags))
        return made[-1]

    yield make
    for r in made:
        r.stop()
    assert not [r.proc.pid for r in made if alive(r.proc.pid)]


@pytest.fixture
def stack(fleet: Fleet, make_router: Callable[..., RouterProc]) -> RouterProc:
    """A router in front of the survivors: 1 prefill and 1 decode engine."""
    return make_router([fleet["p0"]], [fleet["d0"]])


# ---- the fault matrix ------------------------------------------------------------------------


_MATRIX: list[dict[str, Any]] = []


def record(fault: str, moment: str, outcome: str, seconds: float) -> None:
    """One row of the fault matrix; `BATON_FAULT_MATRIX=path` writes them as JSON at the end."""
    _MATRIX.append(
        {
            "fault": fault,
            "moment": moment,
            "outcome": outcome,
            "seconds": round(seconds, 2),
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
        }
    )


@pytest.fixture(scope="session", autouse=True)
def _write_matrix() -> Iterator[None]:
    yield
    path = os.environ.get("BATON_FAULT_MATRIX")
    if path and _MATRIX:
        Path(path).write_text(json.dumps(_MATRIX, indent=1))


# ---- checks ------------------------------------------------------------------------------------


IDLE = (
    "vllm:kv_cache_usage_perc{}",
    "baton:kv_blocks_leased{}",
    "vllm:num_requests_running{}",
    "vllm:num_requests_waiting{}",
)


def wait_idle(server: Server, timeout: float = LEASE_SECONDS + 8) -> float:
    """Seconds until `server` holds no block, lease or request; fails (naming what leaked)
    after `timeout`."""
    start = time.monotonic()
    while True:
        m = server.metrics()
        busy = {k: m[k] for k in IDLE if m[k] != 0}
        if not busy:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"{server.url} leaked: {busy}"
        time.sleep(0.1)


def prompt_ids(seed: int, n: int = 40) -> list[int]:
    """A token-id prompt of `n` tokens, different for each `seed`."""
    return [(seed * 131 + i * 7) % 400 + 20 for i in range(n)]


def body(prompt: list[int] | str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def complete(
    url: str, prompt: list[int] | str, timeout: float = 30, **extra: Any
) -> httpx.Response:
    """A whole completion from `url` (an engine or a router); a hang fails at `timeout`."""
    return httpx.post(f"{url}/v1/completions", json=body(prompt, **extra), timeout=timeout)


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


def prefill_step(prefill: Server, prompt: list[int]) -> dict[str, Any]:
    """Step 1 of the hand-off, sent by hand: the KV params of `prompt`, leased on `prefill`."""
    r = complete(prefill.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 200, r.text
    return dict(r.json()["kv_transfer_params"])


def decode_step(decode: Server, prompt: list[int], params: dict[str, Any], **extra: Any) -> Any:
    """Step 2 of the hand-off, sent by hand: the completion of `prompt` from `params`."""
    return complete(decode.url, prompt, kv_transfer_params=params, **extra)


def open_stream(url: str, prompt: list[int] | str, max_tokens: int, **extra: Any) -> Stream:
    return Stream(url, body(prompt, max_tokens, stream=True, **extra))


class Stream:
    """A streamed completion read chunk by chunk; `finish()` reads it to its end and says how
    it ended: ("done", token ids), ("error", message) or ("broken", exception name)."""

    def __init__(self, url: str, payload: dict[str, Any], timeout: float = 30) -> None:
        self.client = httpx.Client(timeout=timeout)
        self.payload = payload
        self.cm = self.client.stream("POST", f"{url}/v1/completions", json=payload)
        self.response = self.cm.__enter__()
        assert self.response.status_code == 200, self.response.read()
        self.lines = self.response.iter_lines()
        self.ids: list[int] = []
        self.engine = self.response.headers.get("x-baton-engine")

    def read(self, n: int = 1) -> None:
        """Reads `n` token events."""
        got = 0
        while got < n:
            line = next(self.lines)
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                self.ids += event["choices"][0].get("token_ids") or []
                got += 1

    def finish(self) -> tuple[str, Any]:
        try:
            for line in self.lines:
                if line == "data: [DONE]":
                    return "done", self.ids
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "error", event["error"]["message"]
                self.ids += event["choices"][0].get("token_ids") or []
            return "broken", "ended without data: [DONE]"
        except httpx.TimeoutException:
            raise
        except httpx.HTTPError as e:
            return "broken", type(e).__name__
        finally:
            self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cm.__exit__(None, None, None)
        self.client.close()


def stop_core(fleet: Fleet, name: str) -> Process:
    """SIGSTOPs the EngineCore of engine `name`; says so if it has ended already."""
    core = fleet.cores[name]
    assert core.signal(signal.SIGSTOP), f"the EngineCore of {name} ended:\n{fleet[name].log()}"
    return core
