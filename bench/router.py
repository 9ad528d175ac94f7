"""Router overhead (issue 23): the requests/s `baton router` carries on one core, the latency it
adds to 64 concurrent streams, and how its memory and CPU per request grow with 100 engines and
10,000 cached prefixes. Each figure is printed against direct calls to the engine made in the
same run, and against the issue's aim.

Processes: the router (`baton router`, pinned to `--router-cpu`), a fake engine and the load
generator (both pinned to `--client-cpu`). The fake engine and the client are this file's own,
on raw asyncio with pre-encoded bytes (not Starlette, not aiohttp): measured directly, they
carry several times the router's requests/s on one core, so a router figure is the router's,
not the load generator's (`direct` in each table is that ceiling). In (b), a byte relay on the
router's core (this file's too: no HTTP parsed) gives the floor of any data path in Python.

    python bench/router.py --mode throughput   # (a): req/s at 64 connections, vs direct, vs 2,000
    python bench/router.py --mode latency      # (b): added p99 at 64 paced streams, vs 2 ms
    python bench/router.py --mode scale        # (c): RSS and CPU/request, 1 vs 100 engines,
                                               #      0 vs 10,000 prefixes in the index
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import numpy as np

from baton.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
AIM_RPS = 2000.0  # (a) requests/s on one router core
AIM_ADDED_P99_MS = 2.0  # (b) added p99 at 64 streams
PACINGS = ("steps", "independent")  # (b) how the fake engine paces its streams

# ---- the fake engine: raw asyncio, every answer pre-encoded ------------------------------------

_MAX_TOKENS = re.compile(rb'"max_tokens":\s*(\d+)')
_STREAM = re.compile(rb'"stream":\s*true')


def _event(i: int, last: bool, ids: bool) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": f" t{i}"}
    if ids:
        choice["token_ids"] = [i]
    choice["finish_reason"] = "length" if last else None
    event = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "fake"}
    event["choices"] = [choice]
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _whole(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        content_type,
        len(body),
        body,
    )


_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
_MODELS = _whole(
    json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode()
)
_METRICS = _whole(
    b'vllm:num_requests_running{model_name="fake"} 0.0\n'
    b'vllm:num_requests_waiting{model_name="fake"} 0.0\n',
    b"text/plain",
)
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
_EMPTY = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


class _EngineProtocol(asyncio.Protocol):
    """One engine connection: HTTP/1.1 keep-alive requests, one at a time."""

    def __init__(
        self, itl: float, steps: _Steps | None, cache: dict[tuple[int, bool, bool], Any]
    ) -> None:
        self.itl = itl
        self.steps = steps  # None: each stream on a clock of its own
        self.cache = cache
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.pacing: set[asyncio.Future[None]] = set()  # streams being sent

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end]
            i = head.lower().find(b"content-length:")
            length = int(head[i + 15 :].split(b"\r\n", 1)[0]) if i >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self._answer(head, body)

    def _answer(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        line = head[: head.find(b"\r\n")]
        if line.startswith(b"POST /v1/completions"):
            m = _MAX_TOKENS.search(body)
            key = (
                int(m.group(1)) if m else 16,
                bool(_STREAM.search(body)),
                b'"return_token_ids":true' in body,
            )
            answer = self.cache.get(key)
            if answer is None:
                answer = self.cache[key] = _answer_bytes(*key)
            if isinstance(answer, bytes):
                self.transport.write(answer)
            elif self.itl <= 0:
                for piece in answer:
                    self.transport.write(piece)
            elif self.steps is not None:
                self.steps.add(self.transport, answer)
            else:
                self.pacing.add(task := asyncio.ensure_future(self._paced(answer)))
                task.add_done_callback(self.pacing.discard)
        elif line.startswith(b"GET /health"):
            self.transport.write(_EMPTY)
        elif line.startswith(b"GET /v1/models"):
            self.transport.write(_MODELS)
        elif line.startswith(b"GET /metrics"):
            self.transport.write(_METRICS)
        else:
            self.transport.write(_NOT_FOUND)

    async def _paced(self, pieces: list[bytes]) -> None:
        """A stream on its own clock: a token every `itl` from its arrival. The times are fixed
        in advance, so a late wake-up does not move the stream onto another's clock."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        due = loop.time()
        self.transport.write(pieces[0] + pieces[1])  # head and first event at once
        for piece in pieces[2:-1]:
            due += self.itl
            await asyncio.sleep(due - loop.time())
            if self.transport.is_closing():
                return
            self.transport.write(piece)
        self.transport.write(pieces[-1])


class _Steps:
    """An engine's decode steps: every `itl` seconds each stream in flight gets its next token,
    all in the same moment, as each step of a real engine gives every running request one. A
    stream's head and first event go out when it arrives; it joins the next step."""

    def __init__(self, itl: float) -> None:
        self.itl = itl
        self.streams: list[tuple[asyncio.Transport, list[bytes], int]] = []
        self.task: asyncio.Future[None] | None = None

    def add(self, transport: asyncio.Transport, pieces: list[bytes]) -> None:
        if len(pieces) == 3:  # one token: head, its event and the end at once
            transport.write(b"".join(pieces))
            return
        transport.write(pieces[0] + pieces[1])
        self.streams.append((transport, pieces, 2))
        if self.task is None:
            self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while self.streams:
            due += self.itl
            await asyncio.sleep(due - loop.time())
            going = []
            for transport, pieces, i in self.streams:
                if transport.is_closing():
                    continue
                if i == len(pieces) - 2:  # the last event, [DONE] and the end together
                    transport.write(pieces[i] + pieces[-1])
                else:
                    transport.write(pieces[i])
                    going.append((transport, pieces, i + 1))
            self.streams = going
        self.task = None


def _answer_bytes(max_tokens: int, stream: bool, ids: bool) -> bytes | list[bytes]:
    """A whole answer, or a stream's pieces: its head, one chunk per event, [DONE] and the end."""
    if not stream:
        choice = {"index": 0, "text": "".join(f" t{i}" for i in range(max_tokens)),
                  "finish_reason": "length"}  # fmt: skip
        usage = {"prompt_tokens": 8, "completion_tokens": max_tokens,
                 "total_tokens": 8 + max_tokens}  # fmt: skip
        answer = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "fake",
                  "choices": [choice], "usage": usage}  # fmt: skip
        return _whole(json.dumps(answer).encode())
    events = [_chunk(_event(i, i == max_tokens - 1, ids)) for i in range(max_tokens)]
    return [_STREAM_HEAD, *events, _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"]


def serve_engine(count: int, itl: float, pacing: str) -> None:
    """Serves the fake engine on `count` ports (printed on one line) until killed; paced
    streams (`itl` > 0) in steps or each on its own clock (`pacing`)."""
    _use_uvloop()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        cache: dict[tuple[int, bool, bool], Any] = {}
        steps = _Steps(itl) if pacing == "steps" else None
        ports = []
        for _ in range(count):
            server = await loop.create_server(
                lambda: _EngineProtocol(itl, steps, cache), "127.0.0.1", 0, backlog=1024
            )
            ports.append(server.sockets[0].getsockname()[1])
        print(" ".join(map(str, ports)), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# ---- the floor of a Python data path: a byte relay ---------------------------------------------


class _Relay(asyncio.Protocol):
    """One client connection relayed byte for byte to a connection of its own to the engine
    (no HTTP parsed): the least that any proxy in Python on this event loop pays."""

    def __init__(self, engine_port: int) -> None:
        self.engine_port = engine_port
        self.client: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.early: list[bytes] = []  # what the client sent before the engine connection was up
        self.connecting: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = cast(asyncio.Transport, transport)
        self.connecting = asyncio.ensure_future(self._connect(self.client))

    async def _connect(self, client: asyncio.Transport) -> None:
        upstream, _ = await asyncio.get_running_loop().create_connection(
            lambda: _Back(client), "127.0.0.1", self.engine_port
        )
        self.upstream = cast(asyncio.Transport, upstream)
        if client.is_closing():  # the client left while the engine connection was made
            self.upstream.close()
            return
        for data in self.early:
            self.upstream.write(data)

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.early.append(data)
        else:
            self.upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


class _Back(asyncio.Protocol):
    """The engine's side of a relayed connection."""

    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


def serve_relay(engine_port: int) -> None:
    """Serves the byte relay to `engine_port` (its own port printed) until killed."""
    _use_uvloop()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Relay(engine_port), "127.0.0.1", 0, backlog=1024)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# ---- the load generator: raw asyncio streams, pre-encoded requests -----------------------------


def _request(prompt: str, max_tokens: int, stream: bool) -> bytes:
    body = json.dumps({"model": "fake", "prompt": prompt, "max_tokens": max_tokens,
                       "stream": stream}).encode()  # fmt: skip
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[float, float]:
    """Sends `request`, reads its whole answer; (seconds to the first body bytes, to the end)."""
    start = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    if head[9:12] != b"200":
        raise RuntimeError(f"answered {head[:12]!r}")
    lower = head.lower()
    i = lower.find(b"content-length:")
    if i >= 0:
        await reader.readexactly(int(lower[i + 15 : lower.index(b"\r\n", i)]))
        end = time.perf_counter() - start
        return end, end
    first = 0.0
    while True:  # chunked
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        await reader.readexactly(size + 2)
        if not first:
            first = time.perf_counter() - start
        if size == 0:
            return first, time.perf_counter() - start


def _client(
    port: int, requests: list[bytes], count: int, conns: int, cpu: int | None,
    stagger: float, barrier: Any, out: Connection,
) -> None:  # fmt: skip
    """One load process: `count` requests over `conns` connections, sent as answers come; the
    connections start spread over `stagger` seconds (paced streams that start together would
    stay in step, every request arriving in one burst)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    _use_uvloop()

    async def main() -> tuple[float, float, list[float], list[float]]:
        streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(conns)]
        firsts: list[float] = []
        ends: list[float] = []
        left = count

        async def worker(
            k: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            nonlocal left
            await asyncio.sleep(stagger * k / conns)
            while left > 0:
                left -= 1
                first, end = await _exchange(reader, writer, requests[left % len(requests)])
                firsts.append(first)
                ends.append(end)

        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        began = time.monotonic()
        await asyncio.gather(*(worker(k, r, w) for k, (r, w) in enumerate(streams)))
        ended = time.monotonic()
        for _, w in streams:
            w.close()
        return began, ended, firsts, ends

    out.send(asyncio.run(main()))


def load(
    port: int, requests: list[bytes], count: int, conns: int, procs: int, cpu: int | None,
    stagger: float = 0.0,
) -> dict[str, float]:  # fmt: skip
    """`count` requests over `conns` connections split among `procs` client processes."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(procs)
    pipes, workers = [], []
    for k in range(procs):
        mine, theirs = ctx.Pipe(duplex=False)
        share = count // procs + (k < count % procs)
        args = (
            port,
            requests,
            share,
            conns // procs + (k < conns % procs),
            cpu,
            stagger,
            barrier,
            theirs,
        )
        workers.append(ctx.Process(target=_client, args=args))
        pipes.append(mine)
        workers[-1].start()
    if not all(p.poll(600) for p in pipes):
        for w in workers:
            w.kill()
        raise RuntimeError("the load did not finish in 10 minutes")
    results = [p.recv() for p in pipes]
    for w in workers:
        w.join()
    began = min(r[0] for r in results)
    ended = max(r[1] for r in results)
    first = np.array([x for r in results for x in r[2]]) * 1000
    end = np.array([x for r in results for x in r[3]]) * 1000
    return {
        "requests_per_s": len(end) / (ended - began),
        "p50_ms": float(np.percentile(end, 50)),
        "p99_ms": float(np.percentile(end, 99)),
        "ttft_p50_ms": float(np.percentile(first, 50)),
        "ttft_p99_ms": float(np.percentile(first, 99)),
    }


# ---- processes ---------------------------------------------------------------------------------


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _pinned(cpu: int | None) -> Callable[[], None] | None:
    return None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))


def _serve(flags: list[str], cpu: int | None) -> tuple[subprocess.Popen[bytes], list[int]]:
    """This file run with `flags` as a server process; it and the ports it printed."""
    argv = [sys.executable, __file__, *flags]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, preexec_fn=_pinned(cpu))
    assert proc.stdout is not None
    return proc, [int(p) for p in proc.stdout.readline().split()]


def start_engine(
    count: int, itl: float, cpu: int | None, pacing: str = "steps"
) -> tuple[subprocess.Popen[bytes], list[int]]:
    flags = ["--serve-engine", str(count), "--itl", str(itl), "--pacing", pacing]
    return _serve(flags, cpu)


def start_relay(engine_port: int, cpu: int | None) -> tuple[subprocess.Popen[bytes], int]:
    proc, (port,) = _serve(["--serve-relay", str(engine_port)], cpu)
    return proc, port


def start_router(
    engines: Sequence[int], cpu: int | None, migration_limit: int = 3, policy: str = "prefix-aware"
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    argv = [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "router",
            "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--migration-limit", str(migration_limit)]  # fmt: skip
    for p in engines:
        argv += ["--engine", f"http://127.0.0.1:{p}"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, preexec_fn=_pinned(cpu))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the router did not get ready")


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` (VmRSS of /proc/<pid>/status), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def measured(
    port: int, pid: int | None, requests: list[bytes], count: int, args: argparse.Namespace,
    stagger: float = 0.0,
) -> dict[str, float]:  # fmt: skip
    """A warm-up, then `count` requests; with `pid`, that process's CPU per request."""
    shape = (args.concurrency, args.clients, args.client_cpu, stagger)
    load(port, requests, min(count, 1000), *shape)
    cpu = cpu_seconds(pid) if pid is not None else 0.0
    result = load(port, requests, count, *shape)
    if pid is not None:
        result["cpu_ms_per_request"] = (cpu_seconds(pid) - cpu) * 1000 / count
    return result


# ---- the three measures ------------------------------------------------------------------------

PROMPT = "The relay team passes the baton. " * 8


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    """(a): requests/s at `--concurrency` connections, direct and through the router."""
    engine, (engine_port,) = start_engine(1, 0.0, args.client_cpu)
    routers = {
        "router": start_router([engine_port], args.router_cpu),
        "no-migration": start_router([engine_port], args.router_cpu, migration_limit=0),
    }
    results: dict[str, dict[str, float]] = {}
    try:
        for kind, stream in (("whole", False), ("stream", True)):
            requests = [_request(PROMPT, args.max_tokens, stream)]
            results[f"direct/{kind}"] = measured(engine_port, None, requests, args.requests, args)
            for name, (proc, port) in routers.items():
                results[f"{name}/{kind}"] = measured(port, proc.pid, requests, args.requests, args)
    finally:
        _stop(engine, *(p for p, _ in routers.values()))
    print(f"(a) throughput: {args.concurrency} connections, {args.requests} requests each, "
          f"{args.max_tokens} tokens; router on CPU {args.router_cpu}, engine and "
          f"{args.clients} client process(es) on CPU {args.client_cpu}")  # fmt: skip
    print(f"{'':20} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'router CPU ms/req':>18} "
          f"{'x direct':>9} {'x 2000 aim':>11}")  # fmt: skip
    summary: dict[str, float] = {}
    for key, r in results.items():
        kind = key.split("/")[1]
        ratio = r["requests_per_s"] / results[f"direct/{kind}"]["requests_per_s"]
        aim = r["requests_per_s"] / AIM_RPS
        cpu = f"{r['cpu_ms_per_request']:18.3f}" if "cpu_ms_per_request" in r else " " * 18
        print(f"{key:20} {r['requests_per_s']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {cpu} "
              f"{ratio:9.2f} {aim:11.2f}")  # fmt: skip
        if not key.startswith("direct"):
            summary[f"{key}/rps_vs_direct"] = ratio
            summary[f"{key}/rps_vs_aim"] = aim
    return {"results": results, "summary": summary}


def latency(args: argparse.Namespace) -> dict[str, Any]:
    """(b): 64 concurrent streams paced by the engine (`--itl` between tokens), for each pacing:
    `steps`, every stream's token in the same moment, as an engine's decode step sends them
    (the case the aim is judged on), and `independent`, each stream on its own clock."""
    requests = [_request(PROMPT, args.max_tokens, True)]
    count = args.latency_requests
    stagger = args.itl * args.max_tokens  # a stream's length: arrivals spread evenly
    results: dict[str, dict[str, float]] = {}
    for pacing in args.pacing:
        engine, (engine_port,) = start_engine(1, args.itl, args.client_cpu, pacing)
        relay, relay_port = start_relay(engine_port, args.router_cpu)
        router, port = start_router([engine_port], args.router_cpu)
        try:
            for name, at, pid in (("direct", engine_port, None),
                                  ("byte relay", relay_port, relay.pid),
                                  ("router", port, router.pid)):  # fmt: skip
                results[f"{pacing}/{name}"] = measured(at, pid, requests, count, args, stagger)
        finally:
            _stop(engine, relay, router)
    print(f"(b) latency: {args.concurrency} concurrent streams of {args.max_tokens} tokens, "
          f"{args.itl * 1000:.0f} ms between tokens, {count} requests; router on CPU "
          f"{args.router_cpu}")  # fmt: skip
    print(f"{'':24} {'req/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'CPU ms/req':>11}")  # fmt: skip
    for key, x in results.items():
        cpu = f"{x['cpu_ms_per_request']:11.3f}" if "cpu_ms_per_request" in x else ""
        print(f"{key:24} {x['requests_per_s']:8.0f} {x['ttft_p50_ms']:9.2f} "
              f"{x['ttft_p99_ms']:9.2f} {x['p50_ms']:8.2f} {x['p99_ms']:8.2f} {cpu}")  # fmt: skip
    summary: dict[str, float] = {}
    for key in results:
        pacing, name = key.split("/")
        if name == "direct":
            continue
        d, r = results[f"{pacing}/direct"], results[key]
        added_ttft = r["ttft_p99_ms"] - d["ttft_p99_ms"]
        added_end = r["p99_ms"] - d["p99_ms"]
        # The time to the first token is where the router's own work shows: the end of a
        # stream is the engine's pacing, whose jitter a few ms of the router's hide in.
        print(f"{key}: added p99 {added_ttft:.2f} ms to the first token (aim <= "
              f"{AIM_ADDED_P99_MS} ms: x{added_ttft / AIM_ADDED_P99_MS:.2f} of the aim), "
              f"{added_end:.2f} ms to the end")  # fmt: skip
        summary[f"{key}/added_ttft_p99_ms"] = added_ttft
        summary[f"{key}/added_p99_ms"] = added_end
        summary[f"{key}/added_ttft_p99_vs_aim"] = added_ttft / AIM_ADDED_P99_MS
    return {"results": results, "summary": summary}


def _family(i: int) -> str:
    """A prompt of its own family, 6 prefix blocks long (the router hashes 64 characters each)."""
    return f"family {i:05d}: " + "a shared system prompt of some length, " * 9


def scale(args: argparse.Namespace) -> dict[str, Any]:
    """(c): the router's RSS and CPU per request, 1 vs 100 engines, 0 vs 10,000 prefixes."""
    engine, ports = start_engine(args.engines, 0.0, args.client_cpu)
    fill = [_request(_family(i), 1, False) for i in range(args.prefixes)]
    # Measured requests: prompts of the filled families (a full match to walk) when filled.
    ask = [_request(_family(i), args.max_tokens, False) for i in range(0, args.prefixes, 5)]
    results: dict[str, dict[str, float]] = {}
    try:
        for engines in (1, args.engines):
            for prefixes in (0, args.prefixes):
                router, port = start_router(ports[:engines], args.router_cpu)
                try:
                    r: dict[str, float] = {"rss_ready_mib": rss_mib(router.pid)}
                    cpu = cpu_seconds(router.pid)
                    time.sleep(2.0)
                    r["idle_cpu_pct"] = (cpu_seconds(router.pid) - cpu) / 2.0 * 100
                    if prefixes:
                        load(port, fill, len(fill), args.concurrency, args.clients, args.client_cpu)
                    r["rss_filled_mib"] = rss_mib(router.pid)
                    r |= measured(port, router.pid, ask, args.requests, args)
                    r["rss_end_mib"] = rss_mib(router.pid)
                finally:
                    _stop(router)
                results[f"{engines} engines, {prefixes} prefixes"] = r
    finally:
        _stop(engine)
    print(
        f"(c) scale: {args.requests} whole completions measured at {args.concurrency} "
        f"connections, prompts of 6 prefix blocks; router on CPU {args.router_cpu}"
    )
    print(f"{'':28} {'RSS ready':>10} {'RSS filled':>11} {'RSS end':>8} {'idle CPU %':>11} "
          f"{'CPU ms/req':>11} {'req/s':>7} {'CPU x base':>11}")  # fmt: skip
    base = next(iter(results.values()))
    summary: dict[str, float] = {}
    for key, x in results.items():
        ratio = x["cpu_ms_per_request"] / base["cpu_ms_per_request"]
        summary[f"{key}/cpu_vs_base"] = ratio
        summary[f"{key}/rss_delta_mib"] = x["rss_end_mib"] - base["rss_end_mib"]
        print(f"{key:28} {x['rss_ready_mib']:10.1f} {x['rss_filled_mib']:11.1f} "
              f"{x['rss_end_mib']:8.1f} {x['idle_cpu_pct']:11.1f} {x['cpu_ms_per_request']:11.3f} "
              f"{x['requests_per_s']:7.0f} {ratio:11.2f}")  # fmt: skip
    return {"results": results, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("throughput", "latency", "scale", "all"), default="all")
    two = (os.cpu_count() or 1) >= 2
    parser.add_argument("--router-cpu", type=int, default=1 if two else None)
    parser.add_argument("--client-cpu", type=int, default=0 if two else None,
                        help="the fake engine's and the load generator's CPU")  # fmt: skip
    parser.add_argument("--clients", type=int, default=1, help="load generator processes")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=10000, help="per measured run")
    parser.add_argument("--latency-requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens (chunks) per answer")
    parser.add_argument("--itl", type=float, default=0.02, help="(b): seconds between tokens")
    parser.add_argument("--pacing", choices=PACINGS, nargs="+", default=list(PACINGS),
                        help="(b): streams paced in steps, or each on its own clock")  # fmt: skip
    parser.add_argument("--engines", type=int, default=100, help="(c)")
    parser.add_argument("--prefixes", type=int, default=10000, help="(c)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--serve-engine", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--serve-relay", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engine:
        serve_engine(args.serve_engine, args.itl, args.pacing[0])
        return
    if args.serve_relay:
        serve_relay(args.serve_relay)
        return
    out: dict[str, Any] = {}
    for mode, measure in (("throughput", throughput), ("latency", latency), ("scale", scale)):
        if args.mode in (mode, "all"):
            out[mode] = measure(args)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
