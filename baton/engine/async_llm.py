"""AsyncLLM: the API server's client of its EngineCore process.

Starts the core process and does the handshake, sends requests and aborts over ZMQ, and turns the
core's outputs into per-request streams of `RequestOutput` snapshots. Detokenization and stop
strings run here, in the server's event loop, never in the busy loop. If the core process dies,
every open stream fails at once with `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from baton.engine import protocol as p
from baton.engine.config import EngineArgs
from baton.engine.output_processor import OutputProcessor
from baton.engine.outputs import RequestOutput
from baton.engine.processor import check_prompt_token_ids, child_requests
from baton.engine.sampling_params import SamplingParams, resumed_seed
from baton.kv_transfer.fingerprint import Fingerprint
from baton.kv_transfer.params import KVTransferParams
from baton.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

_HELLO_TIMEOUT = 120.0  # starting a Python process that imports torch takes seconds
_READY_TIMEOUT = 1800.0  # loading a real model can take minutes


def check_resume_token_ids(
    ids: list[int],
    num_prompt_tokens: int,
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
) -> None:
    """Raises ValueError, naming the limit, for an answer the engine cannot resume: token ids
    outside the vocabulary, more than one sample, or no room for another token (max_model_len
    and max_tokens count the whole answer, the resumed tokens too)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"resume_token_ids has token ids outside [0, {vocab_size}): {bad[:5]}")
    if params.n != 1:
        raise ValueError(f"an answer can be resumed only with n=1, not n={params.n}")
    if num_prompt_tokens + len(ids) >= max_model_len:
        raise ValueError(
            f"the prompt ({num_prompt_tokens} tokens) and resume_token_ids ({len(ids)} tokens) "
            f"leave no room for another token within max_model_len {max_model_len}"
        )
    if params.max_tokens is not None and len(ids) >= params.max_tokens:
        raise ValueError(
            f"resume_token_ids has {len(ids)} tokens and max_tokens ({params.max_tokens}) counts "
            "the whole answer: there is no token left to generate"
        )


class EngineDeadError(RuntimeError):
    """The EngineCore process is gone; nothing more will be served."""


Sink = Callable[[RequestOutput], bool]  # takes a snapshot in the output loop (True) or not


class _Stream:
    """Latest snapshot of one request. Snapshots are cumulative, so a slow reader just skips to
    the newest one instead of queueing every step.

    With a `sink`, a snapshot that comes while the reader waits in `get`, having taken every
    earlier one, is offered to the sink first, in the output loop: one the sink takes never
    wakes the reader (a streamed answer's tokens written to the socket without a task switch
    each). The last snapshot (finished) always goes to the reader.
    """

    def __init__(self, sink: Sink | None = None) -> None:
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()
        self.sink = sink
        self._waiting = False

    def put(self, item: RequestOutput) -> None:
        offered = self._waiting and not self.ready.is_set() and not item.finished
        if offered and self.sink is not None and self.sink(item):
            return
        self.latest = item
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> RequestOutput:
        self._waiting = True
        try:
            await self.ready.wait()
        finally:
            self._waiting = False
        self.ready.clear()
        if self.error is not None:
            raise self.error
        assert self.latest is not None
        return self.latest


class AsyncLLM:
    # Set by start(), which is the only way to make one.
    args: EngineArgs
    model_path: Path
    tokenizer: Tokenizer
    output_processor: OutputProcessor
    max_model_len: int
    vocab_size: int
    num_blocks: int
    engine_pid: int
    proc: subprocess.Popen[bytes]
    _ctx: zmq.asyncio.Context
    _input: zmq.asyncio.Socket
    _output: zmq.asyncio.Socket
    _tmp: tempfile.TemporaryDirectory[str]

    def __init__(self) -> None:  # use `await AsyncLLM.start(args)`
        self.stats = p.EngineStats()
        self.dead_error: EngineDeadError | None = None
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._dead_callbacks: list[Any] = []
        self._stats_listeners: list[Any] = []
        self._closing = False
        self.kv_transport: str | None = None  # the KV transport in use; None: no connector
        self.kv_ports: list[int] | None = None  # where each rank serves its KV shard
        self.fingerprint: Fingerprint | None = None  # the core's, once it is ready
        self.eos_token_ids: tuple[int, ...] = ()  # the model's, once the core is ready

    @classmethod
    async def start(cls, args: EngineArgs) -> AsyncLLM:
        """Starts the core, does the HELLO / config / READY handshake, returns when READY.

        The core is started by module path (`python -m baton.engine.core_proc`), so this process
        never imports the model stack or torch; the core reads the model and says what the
        server needs of it in READY.
        """
        self = cls()
        self._tmp = tempfile.TemporaryDirectory(prefix="baton-")
        base = f"ipc://{self._tmp.name}"
        self._ctx = zmq.asyncio.Context()
        handshake = self._ctx.socket(zmq.PAIR)
        handshake.bind(f"{base}/handshake")
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(f"{base}/input")
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(f"{base}/output")
        # The core shares the CPUs with this server: OpenMP threads that spin for long at every
        # barrier starve it, ones that sleep at once pay a wake-up per op. Measured on 2 cores,
        # 64 streams: default 620 tok/s, passive 1224, a spin count of 20000 1363.
        env = {"GOMP_SPINCOUNT": "20000", **os.environ}
        level = str(logging.getLogger().getEffectiveLevel())
        command = [sys.executable, "-m", "baton.engine.core_proc", f"{base}/handshake", level]
        self.proc = subprocess.Popen(command, env=env)
        try:
            hello = await self._handshake_recv(handshake, _HELLO_TIMEOUT)
            if not isinstance(hello, p.Hello):
                raise RuntimeError(f"engine core sent {type(hello).__name__} before HELLO")
            config = p.CoreConfig(f"{base}/input", f"{base}/output", args)
            await handshake.send(p.encoder.encode(config))
            ready = await self._handshake_recv(handshake, _READY_TIMEOUT)
            if isinstance(ready, p.Failed):
                raise ValueError(f"the engine failed to start: {ready.error}")
            if not isinstance(ready, p.Ready):
                raise RuntimeError(f"engine core sent {type(ready).__name__} instead of READY")
            self.model_path = Path(ready.model_path)
            self.args = replace(args, model=ready.model_path)
            self.tokenizer = load_tokenizer(args.tokenizer or self.model_path, args.chat_template)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            self._close_sockets()
            raise
        finally:
            handshake.close(linger=0)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_pid = hello.pid
        self.num_blocks = ready.num_blocks
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = tuple(ready.eos_token_ids)
        self.kv_transport = ready.kv_transport
        self.kv_ports = ready.kv_ports
        self.fingerprint = ready.fingerprint
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._output_loop()))
        # A thread waits for the core's exit and tells the loop (Popen has no pollable handle).
        threading.Thread(
            target=self._wait_core, args=(loop,), name="core-exit", daemon=True
        ).start()
        logger.info("engine core %d ready: %d KV blocks", hello.pid, self.num_blocks)
        return self

    async def _handshake_recv(self, sock: zmq.asyncio.Socket, timeout: float) -> p.Handshake:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await sock.poll(timeout=500):
                return p.handshake_decoder.decode(await sock.recv())
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the engine core process exited during start-up (code {self.proc.returncode})"
                )
        raise TimeoutError(f"the engine core did not answer within {timeout:.0f} s")

    # ---- requests ------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        kv_transfer_params: KVTransferParams | None = None,
        resume_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        sink: Sink | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams cumulative snapshots of one request until it finishes.

        `sink(snapshot)`, if given, runs in the output loop for each snapshot but the last that
        comes while the caller waits for the next one, having taken every earlier one: a
        snapshot it takes (True) is not yielded. It must not raise.

        `resume_token_ids` resumes an answer another engine began: it goes on as if this
        engine had produced those output tokens itself (recomputed like a preempted request's;
        `check_resume_token_ids` says what may be resumed), and the snapshots hold the whole
        answer, those tokens first. A seeded request samples from `resumed_seed`; prompt
        logprobs are not computed again. `cache_salt` starts the prompt's block hashes: requests
        with different salts never share prefix-cache blocks.

        Bad prompts raise ValueError before anything is queued. Leaving the loop early (break,
        an exception, a cancelled task) aborts the request in the core and frees its blocks.
        """
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_prompt_token_ids(prompt_token_ids, self.max_model_len, self.vocab_size)
        resumed = resume_token_ids if resume_token_ids is not None else []
        if resume_token_ids is not None:
            check_resume_token_ids(
                resumed, len(prompt_token_ids), sampling_params, self.max_model_len, self.vocab_size
            )
            seed = sampling_params.seed
            sampling_params = replace(
                sampling_params,
                seed=None if seed is None else resumed_seed(seed, len(resumed)),
                prompt_logprobs=None,
            )
        children = child_requests(request_id, sampling_params)
        stream = _Stream(sink)
        self._streams[request_id] = stream
        self.output_processor.add_request(
            request_id,
            prompt,
            prompt_token_ids,
            [c for c, _ in children],
            sampling_params,
            resumed,
        )
        now = time.time()
        group = request_id if sampling_params.n > 1 else None
        finished = False
        try:  # from the first send on: a cancellation anywhere after it must abort
            for child_id, params in children:
                msg = p.EngineCoreRequest(
                    child_id,
                    prompt_token_ids,
                    params,
                    now,
                    priority,
                    group,
                    kv_transfer_params,
                    output_token_ids=resumed,
                    cache_salt=cache_salt,
                )
                await self._input.send(p.encoder.encode(msg))
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.dead_error is None:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        child_ids = self.output_processor.abort(request_id)
        if child_ids and self.dead_error is None:
            await self._input.send(p.encoder.encode(p.AbortRequests(child_ids)))

    async def call_utility(self, method: str) -> Any:
        if self.dead_error is not None:
            raise self.dead_error
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        await self._input.send(p.encoder.encode(p.UtilityCall(call_id, method)))
        return await future

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.call_utility("reset_prefix_cache"))

    # ---- outputs -------------------------------------------------------------------------

    async def _output_loop(self) -> None:
        while True:
            msg = p.output_decoder.decode(await self._output.recv())
            self.stats = msg.stats
            for listener in self._stats_listeners:
                listener(msg.stats)
            updates, to_abort = self.output_processor.process_outputs(msg.outputs)
            for update in updates:
                stream = self._streams.get(update.request_id)
                if stream is not None:
                    stream.put(update)
            if to_abort:  # stop strings found here end the request in the core
                await self._input.send(p.encoder.encode(p.AbortRequests(to_abort)))
            for result in msg.utility_results:
                future = self._calls.pop(result.call_id, None)
                if future is None or future.done():
                    continue
                if result.error is not None:
                    future.set_exception(RuntimeError(result.error))
                else:
                    future.set_result(result.result)

    # ---- the core's death and shutdown ---------------------------------------------------

    def add_stats_listener(self, listener: Any) -> None:
        """`listener(stats)` runs for every message from the core (one per step, plus one after
        inputs that changed the state without a step)."""
        self._stats_listeners.append(listener)

    def add_dead_callback(self, callback: Any) -> None:
        """`callback(error)` runs once, in the event loop, when the core process dies."""
        self._dead_callbacks.append(callback)

    def _wait_core(self, loop: asyncio.AbstractEventLoop) -> None:
        self.proc.wait()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            loop.call_soon_threadsafe(self._on_core_exit)

    def _on_core_exit(self) -> None:
        if self._closing:
            return
        error = EngineDeadError(
            f"the engine core process died (exit code {self.proc.returncode}); "
            "this server cannot serve requests any more"
        )
        self.dead_error = error
        logger.error("%s", error)
        for stream in self._streams.values():
            stream.fail(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        for callback in self._dead_callbacks:
            callback(error)

    async def shutdown(self) -> None:
        self._closing = True
        if self.proc.poll() is None:
            try:
                await self._input.send(p.encoder.encode(p.UtilityCall(-1, "shutdown")))
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.get_running_loop().run_in_executor(None, self.proc.wait, 5)
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
        for task in self._tasks:
            task.cancel()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._ctx.destroy(linger=0)  # closes every socket, the handshake's too
        self._tmp.cleanup()

    def fail_all(self, error: BaseException) -> None:
        """Ends every open request stream with `error`, raised to its reader in place of the
        next snapshot; the reader leaving `generate` aborts the request in the core (its blocks
        are freed), as for a client that leaves. For a server that stops before its requests
        have finished; a stream opened later is not affected."""
        for stream in self._streams.values():
            stream.fail(error)
