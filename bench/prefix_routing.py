"""Prefix-cache hit rate by routing policy, through `baton serve` with 4 aggregated engines.

The workload is a shared-prefix chat service: 8 long system prompts (families), 4 users each,
every user a multi-turn conversation (each turn sends the system prompt, the conversation so far
and a new user message; the streamed answer is appended as the assistant's turn). Users run
concurrently, at most `--concurrency` requests in flight. The engines' KV caches are sized so
that a good placement keeps most of the working set and a bad one thrashes.

Each policy runs on a fresh `baton serve` (empty caches), the same seeded workload, one after
the other:

- `round-robin`;
- `approximate`: prefix-aware on the router's own record of what it sent (character blocks);
- `exact`: prefix-aware on the index built from the engines' KV events;
- `oracle`: no router; this script follows every engine's KV events itself (the router's
  `KVIndex` and `Subscriptions`), tokenizes each request as the engine will, and sends it
  straight to the engine holding most of it (ties: fewest requests in flight from here);
- `approximate-2-routers`, `exact-2-routers` (with `--router-replicas 2`): each with a second
  `baton router` on the same engines, requests alternating between the two (the gateway runs
  two replicas): the approximate index of each replica sees half the traffic, the exact one
  reads the same events.

Measured per policy: the engines' own prefix-cache hit rate (the change of their
`vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total`, summed over engines),
TTFT (to the first token chunk of the stream) p50/p90, the run's wall time and the router
process's CPU seconds per request (/proc utime + stime). Aims (issue 19): exact at least 0.95x
the oracle's hit rate, and TTFT p50 below the approximate policy's.

    python bench/prefix_routing.py [--quick] [--router-replicas 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

if not __package__:  # run as `python bench/prefix_routing.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.ports import free_port
from baton.router.kv_index import KVIndex
from baton.router.kv_subscriber import Subscriptions
from baton.router.prompts import Prompt
from baton.router.tokenizers import TOKENIZER_PATH, prompt_token_ids
from baton.tokenizer import Tokenizer, load_tokenizer
from bench.disagg import Cluster, Setup

CHAT = "/v1/chat/completions"
NUM_ENGINES = 4
BLOCK_SIZE = 16  # the engines' default, which the bench keeps
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
EXACT_FLAGS = ("--policy", "prefix-aware", "--prefix-index", "events")
APPROXIMATE_FLAGS = ("--policy", "prefix-aware", "--prefix-index", "approximate")
_WORD_TEXT = (
    "harbour tide cargo manifest vessel crane berth pilot anchor ledger invoice customs "
    "container freight schedule weather forecast signal beacon channel dredge quay warehouse "
    "clearance permit inspection hull draught ballast tonnage route convoy port starboard "
    "lighthouse buoy current gale swell reef chart compass sextant voyage crew captain "
    "galley deck mast rigging sail keel rudder bridge engine fuel bunker tanker ferry tug"
)
WORDS = tuple(_WORD_TEXT.split())  # the vocabulary of the prompts


@dataclass(frozen=True)
class Workload:
    """The conversations: families of users sharing a system prompt; lengths in tokens."""

    families: int = 8
    users_per_family: int = 4
    turns: int = 8
    system_tokens: tuple[int, int] = (300, 600)  # each family's, uniform in this range
    user_tokens: tuple[int, int] = (20, 60)  # each user message's
    max_tokens: int = 12  # per answer (ignore_eos, greedy)
    concurrency: int = 12  # requests in flight, all users together
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.families, self.users_per_family, self.turns, self.max_tokens) < 1:
            raise ValueError("families, users, turns and max_tokens must be >= 1")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        for low, high in (self.system_tokens, self.user_tokens):
            if not 1 <= low <= high:
                raise ValueError(f"a length range must have 1 <= low <= high, got {low}, {high}")


@dataclass(frozen=True)
class User:
    """One user's conversation: the family's system prompt and the user's messages in turn."""

    family: int
    system: str
    messages: tuple[str, ...]


def _text(rng: random.Random, tokenizer: Tokenizer, lead: str, tokens: int) -> str:
    """`lead` and random words, until the text is at least `tokens` tokens long."""
    words = lead.split()
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < tokens:
        words += rng.choices(WORDS, k=8)
    return " ".join(words)


def build_users(w: Workload, tokenizer: Tokenizer) -> list[User]:
    """The seeded conversations, ordered so that the first requests span every family."""
    rng = random.Random(w.seed)
    systems = [
        _text(
            rng, tokenizer, f"You are desk {f} of the port office.", rng.randint(*w.system_tokens)
        )
        for f in range(w.families)
    ]
    return [
        User(
            family=f,
            system=systems[f],
            messages=tuple(
                _text(rng, tokenizer, f"User {u} asks:", rng.randint(*w.user_tokens))
                for _ in range(w.turns)
            ),
        )
        for u in range(w.users_per_family)
        for f in range(w.families)
    ]


@dataclass(frozen=True)
class Policy:
    """One configuration under test."""

    name: str
    serve_args: tuple[str, ...]
    oracle: bool = False  # this script routes, straight to the engines
    replicas: int = 1  # routers on the same engines, requests alternating between them


POLICIES = (
    Policy("round-robin", ("--policy", "round-robin")),
    Policy("approximate", APPROXIMATE_FLAGS),
    Policy("exact", EXACT_FLAGS),
    Policy("oracle", ("--policy", "round-robin"), oracle=True),
)


# ---------------------------------------------------------------- processes and counters


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def router_pid(serve_pid: int) -> int:
    """The `baton router` that `baton serve` (pid `serve_pid`) started."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if ppid == serve_pid and b"router" in argv:
                return int(proc.name)
    raise RuntimeError(f"no router process under baton serve (pid {serve_pid})")


async def engine_urls(client: httpx.AsyncClient, router: str) -> list[str]:
    engines = (await client.get(f"{router}/engines")).json()["engines"]
    return sorted(e["url"] for e in engines)


async def prefix_counters(client: httpx.AsyncClient, engines: Sequence[str]) -> Counter[str]:
    """The engines' prefix-cache hits and queries (tokens), summed."""
    total: Counter[str] = Counter()
    for url in engines:
        for line in (await client.get(f"{url}/metrics")).text.splitlines():
            name = line.split("{", 1)[0]
            if name in (HITS, QUERIES):
                total[name] += int(float(line.rsplit(" ", 1)[1]))
    return total


async def wait_exact(client: httpx.AsyncClient, router: str, timeout_s: float = 60.0) -> None:
    """Until the router follows every engine's events, synced; then a moment for its
    tokenizer, which it fetches on the same health check."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engines = (await client.get(f"{router}/engines")).json()["engines"]
        events = [(e.get("kv_index") or {}).get("events") or {} for e in engines]
        if len(engines) == NUM_ENGINES and all(ev.get("synced") for ev in events):
            await asyncio.sleep(2.0)
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{router}: engines not in exact mode after {timeout_s:.0f} s")


class RouterReplica:
    """A second `baton router` on the engines of a `baton serve`, with the same flags."""

    def __init__(self, engines: Sequence[str], flags: Sequence[str], log_dir: Path) -> None:
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        cmd = [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "router"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), *flags]
        cmd += [word for url in engines for word in ("--engine", url)]
        self.exact = "events" in flags
        self._log = (log_dir / f"router-replica-{port}.log").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    async def wait_ready(self, client: httpx.AsyncClient, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router replica exited; see {self._log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{self.url}/health")).status_code == 200:
                    if self.exact:
                        await wait_exact(client, self.url)
                    return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"router replica not ready after {timeout_s:.0f} s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


# ---------------------------------------------------------------- routing targets

Pick = Callable[[dict[str, Any], Counter[str]], str]  # (body, in flight per URL) -> base URL


def alternate(routers: Sequence[str]) -> Pick:
    """Requests alternate between the routers (one router: all go to it)."""
    cycle = itertools.cycle(routers)
    return lambda body, in_flight: next(cycle)


class Oracle:
    """Routes on every engine's cache as its KV events tell it, without a router: the engine
    holding the most leading blocks of the prompt, then the one with fewest requests in flight,
    then the one holding fewest blocks (a new family goes to the emptiest cache)."""

    def __init__(self, engines: Sequence[str]) -> None:
        self.engines = list(engines)
        self.index = KVIndex()
        self.subscriptions = Subscriptions(self.index)  # its tasks run in the current loop
        self.tokenizer: Tokenizer | None = None
        self.block_size = 0
        self.cpu_s = 0.0  # thread CPU spent deciding

    async def start(self, client: httpx.AsyncClient, timeout_s: float = 30.0) -> None:
        for url in self.engines:
            self.subscriptions.sync(url, (await client.get(f"{url}/health")).json())
        wire = (await client.get(f"{self.engines[0]}{TOKENIZER_PATH}")).json()
        self.tokenizer = Tokenizer.from_wire(wire)
        deadline = time.monotonic() + timeout_s
        while not all(self.subscriptions.block_size(url) for url in self.engines):
            if time.monotonic() > deadline:
                raise RuntimeError("the oracle's event subscriptions did not sync")
            await asyncio.sleep(0.2)
        self.block_size = self.subscriptions.block_size(self.engines[0]) or 0

    def pick(self, body: dict[str, Any], in_flight: Counter[str]) -> str:
        assert self.tokenizer is not None, "start() first"
        started = time.thread_time()
        tokens = prompt_token_ids(self.tokenizer, CHAT, body)
        if tokens is None:
            raise RuntimeError("the oracle cannot tokenize its own workload's requests")
        matched = self.index.match(
            Prompt(tokens=tokens).exact_hashes(self.block_size), self.engines
        )
        best = max(
            self.engines,
            key=lambda u: (matched[u], -in_flight[u], -self.index.num_blocks(u)),
        )
        self.cpu_s += time.thread_time() - started
        return best

    async def close(self) -> None:
        await self.subscriptions.close()


# ---------------------------------------------------------------- load


@dataclass
class Turn:
    """One request's outcome."""

    messages: list[dict[str, str]]  # what it sent
    sent: int  # its place in send order, over all users
    ttft: float | None = None  # seconds to the first token chunk
    prompt_tokens: int = 0
    reply: str = ""
    error: str | None = None


def _is_token(choice: dict[str, Any]) -> bool:
    """A chunk that carries a token: text, or none yet (a partial character); not the opening
    role-only chunk or the closing finish-reason one."""
    delta = choice.get("delta") or {}
    if delta.get("content"):
        return True
    return "role" not in delta and choice.get("finish_reason") is None


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], turn: Turn
) -> None:
    """Streams one chat completion into `turn`; never raises (a failure lands in `error`)."""
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + CHAT, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:300]
                turn.error = f"HTTP {response.status_code}: {text}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    turn.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                for choice in chunk.get("choices") or ():
                    if turn.ttft is None and _is_token(choice):
                        turn.ttft = time.perf_counter() - start
                    turn.reply += (choice.get("delta") or {}).get("content") or ""
    except Exception as e:  # a load generator reports a broken request and carries on
        turn.error = f"{type(e).__name__}: {e}"
    if turn.error is None and turn.ttft is None:
        turn.error = "the stream ended without a token"


async def converse(
    client: httpx.AsyncClient, users: Sequence[User], w: Workload, model: str, pick: Pick
) -> tuple[list[Turn], float]:
    """Every user's conversation, users concurrently; (turns, wall seconds)."""
    slots = asyncio.Semaphore(w.concurrency)
    in_flight: Counter[str] = Counter()
    sent = itertools.count()
    turns: list[Turn] = []

    async def one_user(user: User) -> None:
        history = [{"role": "system", "content": user.system}]
        for text in user.messages:
            messages = [*history, {"role": "user", "content": text}]
            body = {
                "model": model, "messages": messages, "max_tokens": w.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
            }  # fmt: skip
            async with slots:
                url = pick(body, in_flight)
                turn = Turn(messages, next(sent))
                in_flight[url] += 1
                await stream_chat(client, url, body, turn)
                in_flight[url] -= 1
            turns.append(turn)
            history = [*messages, {"role": "assistant", "content": turn.reply}]

    start = time.perf_counter()
    await asyncio.gather(*(one_user(u) for u in users))
    return turns, time.perf_counter() - start


async def warm_up(client: httpx.AsyncClient, engines: Sequence[str], model: str) -> None:
    """One short request per engine (first-use costs), unlike any prompt of the workload."""
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 2}
    for url in engines:
        (await client.post(url + CHAT, json=body)).raise_for_status()


@dataclass
class Run:
    """One policy's run on one fresh cluster."""

    turns: list[Turn]
    hit_tokens: int  # the engines' prefix-cache counters' change, summed over engines
    query_tokens: int
    wall_s: float
    router_cpu_s: float | None  # all its routers together; None for the oracle
    oracle_cpu_s: float | None  # the oracle's own decisions


async def measure(
    policy: Policy, cluster: Cluster, users: Sequence[User], w: Workload, log_dir: Path
) -> Run:
    """Runs the conversations against one fresh cluster."""
    timeout = httpx.Timeout(300.0, connect=30.0)
    limits = httpx.Limits(max_connections=4 * w.concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        engines = await engine_urls(client, cluster.url)
        model = (await client.get(f"{cluster.url}/v1/models")).json()["data"][0]["id"]
        routers = [cluster.url]
        pids = [router_pid(cluster.proc.pid)]
        replicas = [
            RouterReplica(engines, policy.serve_args, log_dir) for _ in range(policy.replicas - 1)
        ]
        oracle = Oracle(engines) if policy.oracle else None
        try:
            if "events" in policy.serve_args:
                await wait_exact(client, cluster.url)
            for replica in replicas:
                await replica.wait_ready(client)
                routers.append(replica.url)
                pids.append(replica.proc.pid)
            if oracle is not None:
                await oracle.start(client)
            await warm_up(client, engines, model)
            before = await prefix_counters(client, engines)
            cpu_before = sum(cpu_seconds(pid) for pid in pids)
            pick = oracle.pick if oracle is not None else alternate(routers)
            turns, wall = await converse(client, users, w, model, pick)
            cpu = sum(cpu_seconds(pid) for pid in pids) - cpu_before
            after = await prefix_counters(client, engines)
        finally:
            for replica in replicas:
                replica.stop()
            if oracle is not None:
                await oracle.close()
    return Run(
        turns=turns,
        hit_tokens=after[HITS] - before[HITS],
        query_tokens=after[QUERIES] - before[QUERIES],
        wall_s=wall,
        router_cpu_s=None if oracle else cpu,
        oracle_cpu_s=oracle.cpu_s if oracle else None,
    )


def ideal_hit_rate(tokenizer: Tokenizer, turns: Sequence[Turn], block_size: int) -> float:
    """The hit rate of one engine with an unbounded cache, the requests in send order: each
    hits the full blocks of its prompt an earlier prompt had (the last token always computed,
    as the engine does); blocks of generated tokens left out."""
    seen: set[int] = set()
    hits = queries = 0
    for turn in sorted(turns, key=lambda t: t.sent):
        tokens = prompt_token_ids(tokenizer, CHAT, {"messages": turn.messages}) or []
        hashes = Prompt(tokens=tokens).exact_hashes(block_size)
        usable = hashes[: (len(tokens) - 1) // block_size]
        hits += block_size * next((i for i, h in enumerate(usable) if h not in seen), len(usable))
        queries += len(tokens)
        seen.update(hashes)
    return hits / queries if queries else 0.0


def summarize(runs: Sequence[Run], tokenizer: Tokenizer) -> dict[str, Any]:
    """One policy's numbers over its runs: counters summed, TTFTs pooled."""
    turns = [t for run in runs for t in run.turns]
    done = [t for t in turns if t.error is None]
    ttft_ms = np.array([t.ttft for t in done], dtype=float) * 1000.0
    queries = sum(r.query_tokens for r in runs)

    def per_request_ms(values: Sequence[float | None]) -> float | None:
        return None if None in values else 1000.0 * sum(v or 0.0 for v in values) / len(turns)

    return {
        "requests": len(turns),
        "failed": len(turns) - len(done),
        "first_error": next((t.error for t in turns if t.error), None),
        "prompt_tokens_mean": float(np.mean([t.prompt_tokens for t in done])) if done else 0.0,
        "hit_rate": sum(r.hit_tokens for r in runs) / queries if queries else 0.0,
        "hit_rate_runs": [r.hit_tokens / r.query_tokens if r.query_tokens else 0.0 for r in runs],
        "ideal_hit_rate": float(
            np.mean([ideal_hit_rate(tokenizer, r.turns, BLOCK_SIZE) for r in runs])
        ),
        "ttft_p50_ms": float(np.percentile(ttft_ms, 50)) if done else float("nan"),
        "ttft_p90_ms": float(np.percentile(ttft_ms, 90)) if done else float("nan"),
        "wall_s": float(np.mean([r.wall_s for r in runs])),
        "router_cpu_ms_per_request": per_request_ms([r.router_cpu_s for r in runs]),
        "oracle_cpu_ms_per_request": per_request_ms([r.oracle_cpu_s for r in runs]),
    }


# ---------------------------------------------------------------- report


def format_report(results: dict[str, dict[str, Any]]) -> str:
    head = f"{'policy':<16}{'reqs':>6}{'hit rate':>10}{'ideal':>7}{'TTFT p50':>10}{'TTFT p90':>10}"
    lines = [head + f"{'total s':>9}{'router CPU ms/req':>19}"]
    for name, r in results.items():
        cpu = r["router_cpu_ms_per_request"]
        lines.append(
            f"{name:<16}{r['requests']:>6}{r['hit_rate']:>10.3f}{r['ideal_hit_rate']:>7.3f}"
            f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p90_ms']:>10.1f}{r['wall_s']:>9.1f}"
            + ("-" if cpu is None else f"{cpu:.2f}").rjust(19)
        )
        if len(r["hit_rate_runs"]) > 1:
            lines.append("  hit rate per run: " + ", ".join(f"{x:.3f}" for x in r["hit_rate_runs"]))
        if r["failed"]:
            lines.append(f"  {r['failed']} failed; first: {r['first_error']}")
        if r["oracle_cpu_ms_per_request"] is not None:
            lines.append(f"  (oracle's own decisions: {r['oracle_cpu_ms_per_request']:.2f} ms/req)")
    lines.append("(ideal: one engine with an unbounded cache, same requests in send order)")
    lines += [f"{k}: {v:.3f}" for k, v in ratios(results).items()]
    return "\n".join(lines)


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The comparisons the issue asks for, among the policies that ran."""
    out: dict[str, float] = {}

    def ratio(key: str, a: str, b: str, label: str) -> None:
        if a in results and b in results and results[b][key]:
            out[label] = results[a][key] / results[b][key]

    ratio("hit_rate", "exact", "oracle", "hit rate exact/oracle (aim >= 0.95)")
    ratio("hit_rate", "exact", "approximate", "hit rate exact/approximate")
    ratio("hit_rate", "exact", "round-robin", "hit rate exact/round-robin")
    ratio("ttft_p50_ms", "exact", "approximate", "TTFT p50 exact/approximate (aim < 1)")
    ratio("ttft_p50_ms", "exact", "round-robin", "TTFT p50 exact/round-robin")
    ratio("hit_rate", "exact-2-routers", "exact", "hit rate exact 2 routers/1 router")
    ratio(
        "hit_rate",
        "approximate-2-routers",
        "approximate",
        "hit rate approximate 2 routers/1 router",
    )
    ratio(
        "hit_rate",
        "exact-2-routers",
        "approximate-2-routers",
        "hit rate 2 routers exact/approximate",
    )
    ratio(
        "ttft_p50_ms",
        "exact-2-routers",
        "approximate-2-routers",
        "TTFT p50 2 routers exact/approximate",
    )
    return out


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    w = Workload()
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 turns per user, 1 run")
    p.add_argument("--turns", type=int, default=w.turns, help="per user")
    p.add_argument("--concurrency", type=int, default=w.concurrency, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=w.max_tokens, help="per answer")
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument(
        "--repeats", type=int, default=2, help="runs per policy, each on fresh engines; pooled"
    )
    p.add_argument(
        "--kv-blocks", type=int, default=384, help="KV cache blocks per engine (16 tokens each)"
    )
    p.add_argument(
        "--policies",
        default=",".join(x.name for x in POLICIES),
        help="which to run, comma-separated",
    )
    p.add_argument(
        "--router-replicas",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: also run approximate and exact with two routers, requests alternating",
    )
    p.add_argument(
        "--size",
        choices=("tiny", "small"),
        default="tiny",
        help="the model (baton.engine.models.tiny): small makes prefill cost what a hit saves",
    )
    p.add_argument("--json", type=Path, default=None, help="write every number to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    w = Workload(
        turns=2 if args.quick else args.turns,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    chosen = args.policies.split(",")
    policies = [x for x in POLICIES if x.name in chosen]
    if args.router_replicas == 2:
        policies.append(Policy("approximate-2-routers", APPROXIMATE_FLAGS, replicas=2))
        policies.append(Policy("exact-2-routers", EXACT_FLAGS, replicas=2))
    if not policies:
        raise SystemExit(f"no known policy in {args.policies!r}")
    from baton.engine.models.tiny import write_tiny_model  # imports torch

    log_dir = Path(tempfile.mkdtemp(prefix="baton-prefix-routing-"))
    model = write_tiny_model(log_dir / "model", "llama", args.size)
    tokenizer = load_tokenizer(model)
    users = build_users(w, tokenizer)
    engine_args = [
        "--engines", str(NUM_ENGINES), "--model", str(model), "--max-model-len", "2048",
        "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(args.kv_blocks),
    ]  # fmt: skip
    runs: dict[str, list[Run]] = {p.name: [] for p in policies}
    repeats = 1 if args.quick else args.repeats
    for i in range(repeats):
        # Each run on fresh engines; the order reversed every other repeat, so that drift in
        # the machine's background load falls on every policy alike.
        for policy in policies if i % 2 == 0 else policies[::-1]:
            cluster = Cluster(Setup(policy.name, policy.serve_args), engine_args, log_dir)
            try:
                cluster.wait_ready()
                run = asyncio.run(measure(policy, cluster, users, w, log_dir))
            finally:
                cluster.stop()
            runs[policy.name].append(run)
            failed = sum(t.error is not None for t in run.turns)
            print(
                f"run {i + 1} {policy.name}: hit rate {run.hit_tokens / run.query_tokens:.3f}, "
                f"{run.wall_s:.1f} s, {failed} failed",
                flush=True,
            )
    results = {name: summarize(of_policy, tokenizer) for name, of_policy in runs.items()}
    print(
        f"workload: {w.families} system prompts x {w.users_per_family} users, {w.turns} turns, "
        f"{w.concurrency} in flight, {w.max_tokens} tokens per answer; {NUM_ENGINES} engines of "
        f"{args.kv_blocks} KV blocks; {repeats} run(s) each; logs in {log_dir}"
    )
    print(format_report(results))
    if args.json is not None:
        summary = {
            "workload": asdict(w),
            "engine_args": engine_args,
            "results": results,
            "ratios": ratios(results),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
