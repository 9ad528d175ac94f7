"""The EngineCore process: input and output threads around a single-threaded busy loop.

The busy loop owns every piece of scheduler state and touches only queues: the input thread
decodes ZMQ messages into `input_queue`, the output thread encodes what the loop puts in
`output_queue`. Nothing else crosses threads.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from baton import logs
from baton.engine import protocol as p
from baton.engine.core import EngineCore
from baton.engine.executor import WorkerDiedError

logger = logging.getLogger(__name__)

_IDLE_POLL_SECONDS = 1.0  # how often an idle loop checks that its API server is still alive
# How often a loop with nothing to compute looks at KV leases (their expiry) and pulls (a
# backstop: a finished pull also wakes it through the input queue).
_TRANSFER_POLL_SECONDS = 0.05
# How often a loop whose requests wait for their grammars looks again: compiles end on the
# grammar manager's pool, which does not wake the loop, and each wait is added to the answer.
_GRAMMAR_POLL_SECONDS = 0.002
_WAKE = None  # put in the input queue to wake the loop; handled as "nothing"


def run_engine_core(handshake_address: str, log_level: int = logging.INFO) -> None:
    """The EngineCore process, as `AsyncLLM.start` runs it (`python -m`, below)."""
    logs.configure(log_level, component="engine-core")
    parent = os.getppid()
    ctx = zmq.Context()
    handshake = ctx.socket(zmq.PAIR)
    handshake.connect(handshake_address)
    handshake.send(p.encoder.encode(p.Hello(pid=os.getpid())))
    config = p.handshake_decoder.decode(handshake.recv())
    if not isinstance(config, p.CoreConfig):
        raise RuntimeError(f"expected the core config, got {type(config).__name__}")
    # What the imports made lives as long as the process: out of the collector's way, so that
    # its full passes (set off by the block pool's many small objects) do not walk torch's.
    gc.freeze()
    try:
        core = EngineCore(config.engine_args)
    except Exception as e:  # the server reports it and exits: a bad model is not a crash loop
        logger.exception("engine failed to start")
        handshake.send(p.encoder.encode(p.Failed(error=f"{type(e).__name__}: {e}")))
        handshake.close(linger=1000)
        return
    inputs: queue.Queue[p.CoreInput | None] = queue.Queue()
    outputs: queue.Queue[p.EngineCoreOutputs | None] = queue.Queue()
    threading.Thread(
        target=_input_thread, args=(ctx, config.input_address, inputs), daemon=True
    ).start()
    sender = threading.Thread(
        target=_output_thread, args=(ctx, config.output_address, outputs), daemon=True
    )
    sender.start()
    worker = core.connector_worker
    if worker is not None:
        # A finished pull wakes the loop at once instead of at its next poll.
        worker.wake = lambda: inputs.put(_WAKE)
    ready = p.Ready(
        num_blocks=core.num_blocks,
        max_model_len=core.max_model_len,
        model_path=str(core.model_path),
        vocab_size=core.model_config.vocab_size,
        eos_token_ids=list(core.model_config.eos_token_ids),
        kv_transport=worker.transport_name if worker is not None else None,
        kv_ports=worker.ports if worker is not None else None,
        fingerprint=core.fingerprint,
    )
    handshake.send(p.encoder.encode(ready))
    handshake.close(linger=1000)
    try:
        BusyLoop(core, inputs, outputs, parent).run()
    except WorkerDiedError as e:  # the server sees this process exit and fails its requests
        logger.error("%s; the engine stops", e)
        raise SystemExit(1) from None
    finally:
        core.shutdown()
    outputs.put(None)
    sender.join(timeout=5)


def _input_thread(ctx: zmq.Context, address: str, inputs: queue.Queue) -> None:
    sock = ctx.socket(zmq.PULL)
    sock.connect(address)
    while True:
        try:
            inputs.put(p.input_decoder.decode(sock.recv()))
        except Exception:  # a message we cannot read is logged, never fatal
            logger.exception("dropping an undecodable message")


def _output_thread(ctx: zmq.Context, address: str, outputs: queue.Queue) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address)
    while (item := outputs.get()) is not None:
        sock.send(p.encoder.encode(item))
    sock.close(linger=2000)


@dataclass
class BusyLoop:
    """The EngineCore's one thread of scheduling; it talks to the others through two queues."""

    core: EngineCore
    inputs: queue.Queue[p.CoreInput | None]
    outputs: queue.Queue[p.EngineCoreOutputs | None]
    parent_pid: int  # the API server: the loop exits once it is gone
    running: bool = True
    _results: list[p.UtilityResult] = field(default_factory=list)  # for the next message
    _next_parent_check: float = 0.0

    def _orphaned(self) -> bool:
        """True once the API server is gone; asked at most every `_IDLE_POLL_SECONDS`."""
        now = time.monotonic()
        if now < self._next_parent_check:
            return False
        self._next_parent_check = now + _IDLE_POLL_SECONDS
        return os.getppid() != self.parent_pid

    def run(self) -> None:
        core = self.core
        idle = False  # the last step changed nothing: wait for something to happen
        while self.running:
            handled = False
            busy = core.has_unfinished_requests()
            pending = core.has_pending_transfers()
            # Nothing to compute, or nothing that could be computed: block rather than spin (a
            # spinning loop takes the GIL and the CPU from the threads doing the pulls).
            if not busy or idle:
                timeout = _TRANSFER_POLL_SECONDS if busy or pending else _IDLE_POLL_SECONDS
                if core.scheduler.is_compiling():
                    timeout = _GRAMMAR_POLL_SECONDS
                try:  # wake up now and then to notice an orphaned process or expired leases
                    self._handle(self.inputs.get(timeout=timeout))
                    handled = True
                except queue.Empty:
                    if os.getppid() != self.parent_pid:
                        logger.warning("API server is gone; exiting")
                        return
                    core.check_health()  # an idle engine notices a dead worker too
                    if not (busy or pending):
                        continue
            while True:
                try:
                    self._handle(self.inputs.get_nowait())
                    handled = True
                except queue.Empty:
                    break
            busy = core.has_unfinished_requests()
            if busy and self._orphaned():  # a busy loop computes for nobody otherwise
                logger.warning("API server is gone; exiting with requests unfinished")
                return
            result = core.step() if busy or core.has_pending_transfers() else None
            idle = result is None
            if result is None and (handled or self._results):
                # Inputs alone changed the state (an abort of the last request): the server's
                # gauges must see the cache go back to idle.
                result = p.EngineCoreOutputs([], core.scheduler.make_stats())
            if result is not None:
                result.utility_results, self._results = self._results, []
                self.outputs.put(result)

    def _handle(self, msg: p.CoreInput | None) -> None:
        core = self.core
        if msg is _WAKE:
            return
        if isinstance(msg, p.EngineCoreRequest):
            try:
                core.add_request(msg)
            except ValueError as e:  # the server checks first; this is the last line of defence
                logger.warning("rejected request %s: %s", msg.request_id, e)
        elif isinstance(msg, p.AbortRequests):
            core.abort_requests(msg.request_ids)
        elif isinstance(msg, p.UtilityCall):
            self._results.append(self._utility(msg))

    def _utility(self, call: p.UtilityCall) -> p.UtilityResult:
        result: Any = None
        if call.method == "reset_prefix_cache":
            result = self.core.reset_prefix_cache()
        elif call.method == "shutdown":
            self.running = False
        else:
            return p.UtilityResult(call.call_id, error=f"unknown utility {call.method!r}")
        return p.UtilityResult(call.call_id, result=result)


if __name__ == "__main__":
    # `python -m baton.engine.core_proc HANDSHAKE_ADDRESS LOG_LEVEL`, as `AsyncLLM.start` runs
    # it: by module path, so that the API server never imports the engine's model stack.
    run_engine_core(sys.argv[1], int(sys.argv[2]))
