"""`baton serve`: a router and its engines as local processes on one machine.

Starts N prefill and M decode engines (or K aggregated ones) of one model on free ports, waits
until every engine is healthy while passing their start-up logs through (model load, KV
sizing), then starts `baton router` in front of them and prints the endpoint with an example.
Ctrl-C or SIGTERM stops the router, then the engines (each drains), then kills what lingers; a
second signal kills at once. A process that dies during start-up stops the rest, and the exit
code is non-zero; an engine that dies later is restarted on its port, as Kubernetes restarts a
pod, and the router's health checks find it again. Engine and router flags given to `baton
serve` are passed on to them.

`--api-key` (or $BATON_API_KEY) turns keys on: the router requires it from clients and the
engines from the router (the same key, as the router's upstream key). It reaches the children
in their environment, not on their command lines, where any local user could read it. The
prefill and decode engines share a hand-off secret made for this run alone, the same way.

`--prometheus [PORT]` also runs a local Prometheus that scrapes the router and the engines (see
`baton.local_prometheus`), started with the engines and stopped with the router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import json
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from baton.http_server import API_KEY_ENV, HTTPServer
from baton.kv_transfer.keyring import SECRET_ENV, new_secret
from baton.local_prometheus import (
    EngineTarget,
    LocalPrometheus,
    PrometheusConfig,
    add_prometheus_args,
    prometheus_from_args,
)
from baton.ports import free_port
from baton.router.cli import UPSTREAM_API_KEY_ENV, add_routing_args

_LOG_TAIL = 40  # lines of a child's output kept for the error report
_POLL_SECONDS = 0.2
_PROGRESS_SECONDS = 5.0
# An engine that dies is restarted after a backoff that doubles while it keeps dying (a crash
# loop must not eat the machine), up to --restart-max-seconds, and starts small again once it
# stayed up for a while.
_RESTART_MIN_SECONDS = 1.0
_RESTART_MAX_SECONDS = 30.0  # --restart-max-seconds' default
_RESTART_STABLE_SECONDS = 60.0
# Engine flags `baton serve` sets itself for each engine. The keys go by environment; TLS is
# left out: the engines talk plain HTTP to a router on the same machine.
_OWN_ENGINE_FLAGS = {"host", "port", "role", "model", "kv_port", "api_keys", "kv_secret_file"}
_OWN_ENGINE_FLAGS |= {"kv_events_config"}  # each engine publishes on ports of its own
_OWN_ENGINE_FLAGS |= {"ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "ssl_cert_reqs"}


def _say(message: str) -> None:
    print(f"[serve] {message}", file=sys.stderr, flush=True)


# ---- flags passed through --------------------------------------------------------------------


def _engine_parser() -> argparse.ArgumentParser:
    """The engine's own parser (imported here: it loads torch, and only serve needs it)."""
    from baton.engine.api.cli import add_server_args

    parser = argparse.ArgumentParser(add_help=False)
    add_server_args(parser)
    return parser


def _pass_through(actions: Sequence[argparse.Action], group: argparse._ArgumentGroup) -> None:
    """Adds copies of `actions` to `group` that leave the namespace alone unless given (so
    only the flags a user gave are passed on), under dests prefixed `engine__`."""
    for action in actions:
        if action.dest in _OWN_ENGINE_FLAGS or not action.option_strings or action.dest == "help":
            continue
        kwargs: dict[str, object] = {
            "dest": f"engine__{action.dest}",
            "default": argparse.SUPPRESS,
            "help": action.help,
        }
        if isinstance(action, argparse.BooleanOptionalAction):
            names = [o for o in action.option_strings if not o.startswith("--no-")]
            group.add_argument(*names, action=argparse.BooleanOptionalAction, **kwargs)  # type: ignore[arg-type]
        elif action.nargs == 0:  # store_true
            group.add_argument(*action.option_strings, action="store_true", **kwargs)  # type: ignore[arg-type]
        else:
            group.add_argument(
                *action.option_strings,
                type=action.type,  # type: ignore[arg-type]
                choices=action.choices,
                metavar=action.metavar or action.dest.upper(),
                **kwargs,  # type: ignore[arg-type]
            )


def _argv(actions: Sequence[argparse.Action], values: dict[str, object], prefix: str) -> list[str]:
    """The command-line words that give `values` (by dest, with `prefix`) to `actions`."""
    words: list[str] = []
    for action in actions:
        key = prefix + action.dest
        if not action.option_strings or key not in values:
            continue
        value = values[key]
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:
            if value:
                words.append(flag)
        else:
            words += [flag, str(value)]
    return words


def add_args(parser: argparse.ArgumentParser) -> None:
    """`baton serve`'s flags: its own, the router's (routing group) and the engines'."""
    parser.add_argument("--model", default=None, help="model folder (default: the built-in one)")
    parser.add_argument("--prefill", type=int, default=None, help="prefill engines (default 1)")
    parser.add_argument("--decode", type=int, default=None, help="decode engines (default 1)")
    parser.add_argument(
        "--engines",
        type=int,
        default=0,
        help="aggregated engines (role both); alone, it means no prefill or decode engines",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the router's address")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"the key clients must send the router (`Authorization: Bearer KEY`); the engines "
        f"require it from the router too (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument(
        "--stop-timeout", type=float, default=30.0, help="seconds each process gets to stop"
    )
    parser.add_argument(
        "--restart-max-seconds",
        type=float,
        default=_RESTART_MAX_SECONDS,
        help="the longest wait before restarting an engine that keeps dying (the wait starts at "
        "1 s and doubles with each death; like systemd's RestartMaxDelaySec)",
    )
    add_prometheus_args(parser)
    routing = parser.add_argument_group("router (passed to baton router)")
    add_routing_args(routing)
    for action in routing._group_actions:
        action.default = argparse.SUPPRESS
    engine = parser.add_argument_group("engines (passed to every baton engine)")
    _pass_through(_engine_parser()._actions, engine)


# ---- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How many engines of which role, and the command-line words for each process."""

    num_prefill: int
    num_decode: int
    num_both: int
    engine_words: tuple[str, ...]  # flags every engine gets
    router_words: tuple[str, ...]  # routing flags the router gets
    host: str
    port: int
    log_level: str
    api_key: str | None = field(default=None, repr=False)  # None: no keys anywhere
    prometheus: PrometheusConfig | None = None  # None: no local Prometheus

    def __post_init__(self) -> None:
        counts = (self.num_prefill, self.num_decode, self.num_both)
        if min(counts) < 0:
            raise ValueError(f"engine counts must be >= 0, got {counts}")
        if sum(counts) == 0:
            raise ValueError("nothing to serve: give --prefill/--decode or --engines")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ValueError(
                "prefill and decode engines come together (both > 0); for engines that serve "
                "alone use --engines K"
            )


def plan_from_args(args: argparse.Namespace) -> Plan:
    values = vars(args)
    disaggregated = args.prefill is not None or args.decode is not None or not args.engines
    num_prefill = (1 if args.prefill is None else args.prefill) if disaggregated else 0
    num_decode = (1 if args.decode is None else args.decode) if disaggregated else 0
    parser = _engine_parser()
    engine_words = _argv(parser._actions, values, "engine__")
    if args.model is not None:
        engine_words = ["--model", args.model, *engine_words]
    if "engine__disable_uvicorn_access_log" not in values:
        engine_words.append("--disable-uvicorn-access-log")
    if "engine__gpu_memory_utilization" not in values:
        # The engines share one GPU (on CPU the flag is unused): each gets an equal share of
        # the 0.9 one engine takes alone.
        share = parser.get_default("gpu_memory_utilization") / (
            num_prefill + num_decode + args.engines
        )
        engine_words += ["--gpu-memory-utilization", f"{share:.4f}"]
    routing = argparse.ArgumentParser(add_help=False)
    add_routing_args(routing)
    router_words = _argv(routing._actions, values, "")
    traces = values.get("engine__otlp_traces_endpoint")  # an engine flag the router takes too
    if traces:
        router_words += ["--otlp-traces-endpoint", str(traces)]
    return Plan(
        num_prefill=num_prefill,
        num_decode=num_decode,
        num_both=args.engines,
        engine_words=tuple(engine_words),
        router_words=tuple(router_words),
        host=args.host,
        port=args.port,
        log_level=getattr(args, "log_level", "INFO"),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        prometheus=prometheus_from_args(args),
    )


# ---- processes -------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when `baton serve` dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """One process `baton serve` started, with its output passed through under its name."""

    name: str
    url: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict, repr=False)  # the whole environment
    health_path: str = "/health"  # answers 200 once it is ready
    proc: asyncio.subprocess.Process | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_LOG_TAIL))
    ready_after: float | None = None
    _pump: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.env or None,
            start_new_session=True,  # our signals reach it from us, in order, not from the tty
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        self._pump = asyncio.create_task(self._pass_output())

    async def _pass_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.returncode is not None

    async def exit_code(self) -> int:
        """Its exit code, once it has exited. Polled: `Process.wait` (Python 3.11) waits for
        the output pipe to close too, which a process it started may hold open."""
        while self.proc is None or self.proc.returncode is None:
            await asyncio.sleep(_POLL_SECONDS)
        return self.proc.returncode

    def signal(self, sig: signal.Signals) -> None:
        """SIGTERM to the child (an engine stops its own core process); SIGKILL to its whole
        process group (the core too)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        if sig == signal.SIGKILL:
            self.kill_group()
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def kill_group(self) -> None:
        """SIGKILL to the child's process group: what it started too, even once it has exited
        itself (the group lives on while any of them does)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def wait(self, timeout: float) -> bool:
        if self.proc is None:
            return True
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            return False
        if self._pump is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._pump, 2)
        return True


class Supervisor:
    """Starts the engines and the router, watches them, stops them."""

    def __init__(
        self,
        plan: Plan,
        startup_timeout: float,
        stop_timeout: float,
        restart_max_seconds: float = _RESTART_MAX_SECONDS,
    ) -> None:
        if not restart_max_seconds >= 0:
            raise ValueError(f"--restart-max-seconds must be >= 0, got {restart_max_seconds}")
        self.plan = plan
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.restart_max_seconds = restart_max_seconds
        self.engines: list[Child] = []
        self.router: Child | None = None
        # Made here: a missing `prometheus` binary fails before any engine loads.
        self.local_prometheus = LocalPrometheus(plan.prometheus) if plan.prometheus else None
        self.prometheus: Child | None = None
        self.stopping = asyncio.Event()
        self._kill_now = False
        self._kv_secret = new_secret()  # this run's hand-off secret

    def _baton(self, *words: str) -> list[str]:
        return [sys.executable, "-m", "baton.cli", "--log-level", self.plan.log_level, *words]

    def _env(self, **keys: str | None) -> dict[str, str]:
        """Our environment with the children's keys set as given (unset when None), so that a
        key in our own environment reaches only the child it is meant for."""
        env = {k: v for k, v in os.environ.items() if k not in keys}
        env.update({k: v for k, v in keys.items() if v is not None})
        return env

    def auth_headers(self) -> dict[str, str]:
        key = self.plan.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _engine(self, role: str, index: int) -> Child:
        port = free_port()
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        }  # the router follows them (see baton.router.kv_subscriber)
        argv = self._baton(
            "engine", "--host", "127.0.0.1", "--port", str(port), "--role", role,
            "--kv-events-config", json.dumps(events), *self.plan.engine_words,
        )  # fmt: skip
        name = f"{'engine' if role == 'both' else role}-{index}"
        env = self._env(
            **{API_KEY_ENV: self.plan.api_key, UPSTREAM_API_KEY_ENV: None},
            **{SECRET_ENV: self._kv_secret},
        )
        return Child(name, f"http://127.0.0.1:{port}", argv, env)

    async def run(self) -> int:
        with HTTPServer.handle_signals(self._on_signal):
            try:
                if not await self._start():
                    return 1
                return await self._watch()
            finally:
                await self._stop_all()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stopping.is_set():
            _say(f"{sig.name} again: killing everything now")
            self._kill_now = True
            for child in self._children():
                child.signal(signal.SIGKILL)
            return
        _say(f"{sig.name}: stopping (again to kill at once)")
        self.stopping.set()

    def _children(self) -> list[Child]:
        return [*self.engines, *self._front()]

    def _front(self) -> list[Child]:
        """The processes stopped before the engines: the router and the local Prometheus."""
        return [c for c in (self.prometheus, self.router) if c is not None]

    def _prometheus(self) -> Child | None:
        """The local Prometheus (--prometheus) that scrapes the router and the engines. It
        starts with the engines: their addresses are known, and a taken port fails early."""
        if self.local_prometheus is None:
            return None
        p = self.plan
        host = "127.0.0.1" if p.host in ("0.0.0.0", "::") else p.host
        engines = [
            EngineTarget(c.url.removeprefix("http://"), c.name, c.name.split("-")[0])
            for c in self.engines
        ]
        argv = self.local_prometheus.command(f"{host}:{p.port}", engines)
        env = self._env(**{API_KEY_ENV: None, UPSTREAM_API_KEY_ENV: None, SECRET_ENV: None})
        url = self.local_prometheus.url
        return Child("prometheus", url, argv, env, health_path="/-/ready")

    async def _start(self) -> bool:
        p = self.plan
        roles = [("prefill", p.num_prefill), ("decode", p.num_decode), ("both", p.num_both)]
        self.engines = [self._engine(role, i) for role, n in roles for i in range(n)]
        what = " + ".join(f"{n} {r if r != 'both' else 'aggregated'}" for r, n in roles if n)
        _say(f"starting {what} engine(s); each loads the model and sizes its KV cache")
        self.prometheus = self._prometheus()
        starting = [*self.engines, *([self.prometheus] if self.prometheus else [])]
        for child in starting:
            await child.start()
        if not await self._wait_healthy(starting):
            return False
        words = ["router", "--host", p.host, "--port", str(p.port), *p.router_words]
        for child in self.engines:
            role = {"prefill": "--prefill", "decode": "--decode"}.get(child.name.split("-")[0])
            words += [role or "--engine", child.url]
        host = "127.0.0.1" if p.host in ("0.0.0.0", "::") else p.host
        key = p.api_key
        env = self._env(**{API_KEY_ENV: key, UPSTREAM_API_KEY_ENV: key, SECRET_ENV: None})
        self.router = Child("router", f"http://{host}:{p.port}", self._baton(*words), env)
        _say(f"all engines ready; starting the router on {p.host}:{p.port}")
        await self.router.start()
        if not await self._wait_healthy([self.router]):
            return False
        await self._banner(self.router.url, what)
        return True

    async def _wait_healthy(self, children: list[Child]) -> bool:
        started = time.monotonic()
        last_progress = started
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as client:
            while True:
                if self.stopping.is_set():
                    return False
                for child in children:
                    if child.exited:
                        assert child.proc is not None
                        await child.wait(2)
                        _say(
                            f"{child.name} exited with code {child.proc.returncode} during "
                            f"start-up; stopping everything. Its last lines:\n  "
                            + "\n  ".join(child.tail)
                        )
                        return False
                    health = child.url + child.health_path
                    if child.ready_after is None and await _healthy(client, health):
                        child.ready_after = time.monotonic() - started
                        _say(f"{child.name} ready at {child.url} ({child.ready_after:.1f} s)")
                waiting = [c.name for c in children if c.ready_after is None]
                if not waiting:
                    return True
                now = time.monotonic()
                if now - started > self.startup_timeout:
                    _say(f"not ready after {self.startup_timeout:.0f} s: {', '.join(waiting)}")
                    return False
                if now - last_progress > _PROGRESS_SECONDS:
                    _say(f"waiting for {', '.join(waiting)} ({now - started:.0f} s)")
                    last_progress = now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), _POLL_SECONDS)

    async def _banner(self, url: str, layout: str) -> None:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as client,
            client.get(f"{url}/v1/models", headers=self.auth_headers()) as response,
        ):
            models = (await response.json())["data"]
        model = models[0]["id"] if models else "MODEL"
        example = json.dumps({"model": model, "prompt": "The relay team", "max_tokens": 16})
        # The key itself is not printed: terminals and CI logs keep what they show.
        auth = ' -H "Authorization: Bearer $BATON_API_KEY"' if self.plan.api_key else ""
        print(
            f"\nBaton is serving `{model}` at {url}/v1 ({layout} engines)\n"
            f"  curl -s {url}/v1/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"    -d '{example}'\n"
            f"Metrics: {url}/metrics   Engines: {url}/engines   Ctrl-C stops everything.\n",
            flush=True,
        )
        if self.local_prometheus is not None:
            print(self.local_prometheus.summary() + "\n", flush=True)

    async def _watch(self) -> int:
        """Until a signal (exit 0) or the router's death (exit 1), restarting engines (and the
        local Prometheus) that die.

        The restarts are cancelled before anything is stopped: a signal during a backoff starts
        no new engine."""
        watched = [*self.engines, *([self.prometheus] if self.prometheus else [])]
        restarts = [asyncio.create_task(self._keep_alive(child)) for child in watched]
        try:
            while not self.stopping.is_set():
                if self.router is not None and self.router.exited:
                    _say("the router exited; stopping the engines")
                    return 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), 0.5)
            return 0
        finally:
            for task in restarts:
                task.cancel()
            await asyncio.gather(*restarts, return_exceptions=True)

    async def _keep_alive(self, child: Child) -> None:
        """Restarts `child` on its port with its flags each time it exits, after a backoff of
        `_RESTART_MIN_SECONDS` doubling to `restart_max_seconds`, which starts over once it
        stayed up `_RESTART_STABLE_SECONDS`."""
        first = backoff = min(_RESTART_MIN_SECONDS, self.restart_max_seconds)
        for restart in itertools.count(1):
            up_since = time.monotonic()
            code = await child.exit_code()
            if time.monotonic() - up_since >= _RESTART_STABLE_SECONDS:
                backoff = first
            # Its EngineCore leaves on its own only when it next looks for its parent, and a
            # busy or stuck one would hold the accelerator (and the output pipe) meanwhile.
            child.kill_group()
            await child.wait(2)
            _say(
                f"{child.name} exited with code {code}; restarting in {backoff:g} s "
                f"(restart {restart})"
            )
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self.restart_max_seconds)
            await child.start()

    async def _stop_all(self) -> None:
        """The router (no new requests) and Prometheus first, then the engines (they drain),
        then SIGKILL; then Prometheus's temp dir goes."""
        for group in (self._front(), self.engines):
            live = [c for c in group if c.proc is not None and not c.exited]
            for child in live:
                child.signal(signal.SIGKILL if self._kill_now else signal.SIGTERM)
            for child in live:
                if not await child.wait(self.stop_timeout):
                    _say(f"{child.name} did not stop in {self.stop_timeout:.0f} s; killing it")
                    child.signal(signal.SIGKILL)
                    await child.wait(5)
        if self.local_prometheus is not None:
            self.local_prometheus.cleanup()
        if self.engines or self.router:
            _say("stopped")


async def _healthy(client: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with client.get(url) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


def run(args: argparse.Namespace) -> int:
    """`baton serve`: until Ctrl-C or SIGTERM; non-zero when start-up failed."""
    plan = plan_from_args(args)
    supervisor = Supervisor(plan, args.startup_timeout, args.stop_timeout, args.restart_max_seconds)
    return asyncio.run(supervisor.run())
