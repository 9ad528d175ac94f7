"""The EngineCore process: input and output threads around a single-threaded busy loop.

The busy loop owns every piece of scheduler state and touches only queues: the input thread
decodes ZMQ messages into `input_queue`, the output thread encodes what the loop puts in
`output_queue`. Nothing else crosses threads.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import zmq

from baton.engine import protocol as p
from baton.engine.core import EngineCore
from baton.engine.executor import WorkerDiedError
from baton.engine.request import Request

logger = logging.getLogger(__name__)

_IDLE_POLL_SECONDS = 1.0  # how often an idle loop checks that its API server is still alive
# How often a loop with nothing to compute looks at KV leases (their expiry) and pulls (a
# backstop: a finished pull also wakes it through the input queue).
_TRANSFER_POLL_SECONDS = 0.05
_WAKE = None  # put in the input queue to wake the loop; handled as "nothing"


def run_engine_core(handshake_address: str, log_level: int = logging.INFO) -> None:
    """Entry point of the EngineCore process (spawned by `AsyncLLM.start`)."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s[core]: %(message)s")
    parent = os.getppid()
    ctx = zmq.Context()
    handshake = ctx.socket(zmq.PAIR)
    handshake.connect(handshake_address)
    handshake.send(p.encoder.encode(p.Hello(pid=os.getpid())))
    config = p.handshake_decoder.decode(handshake.recv())
    if not isinstance(config, p.CoreConfig):
        raise RuntimeError(f"expected the core config, got {type(config).__name__}")
    try:
        core = EngineCore(config.engine_args)
    except Exception as e:  # the server reports it and exits: a bad model is not a crash loop
        logger.exception("engine failed to start")
        handshake.send(p.encoder.encode(p.Failed(error=f"{type(e).__name__}: {e}")))
        handshake.close(linger=1000)
        return
    inputs: queue.Queue[p.CoreInput | None] = queue.Queue()
    outputs: queue.Queue[p.CoreOutputs | None] = queue.Queue()
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
        core.num_blocks,
        core.max_model_len,
        str(core.model_path),
        worker.transport_name if worker is not None else None,
        worker.ports if worker is not None else None,
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


class BusyLoop:
    def __init__(
        self, core: EngineCore, inputs: queue.Queue, outputs: queue.Queue, parent_pid: int
    ) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.running = True
        self._results: list[p.UtilityResult] = []
        self._nothing_to_compute = False
        self._next_parent_check = 0.0

    def _orphaned(self) -> bool:
        """True once the API server is gone; asked at most every `_IDLE_POLL_SECONDS`."""
        now = time.monotonic()
        if now < self._next_parent_check:
            return False
        self._next_parent_check = now + _IDLE_POLL_SECONDS
        return os.getppid() != self.parent_pid

    def run(self) -> None:
        core = self.core
        while self.running:
            handled = False
            transfers = core.has_pending_transfers()
            # Idle, or only waiting on KV pulls: block rather than spin (a spinning loop takes
            # the GIL and the CPU from the threads doing the pulls).
            if not core.has_unfinished_requests() or (transfers and self._nothing_to_compute):
                timeout = _TRANSFER_POLL_SECONDS if transfers else _IDLE_POLL_SECONDS
                try:  # wake up now and then to notice an orphaned process or expired leases
                    self._handle(self.inputs.get(timeout=timeout))
                    handled = True
                except queue.Empty:
                    if os.getppid() != self.parent_pid:
                        logger.warning("API server is gone; exiting")
                        return
                    core.check_health()  # an idle engine notices a dead worker too
                    if not transfers:
                        continue
            while True:
                try:
                    self._handle(self.inputs.get_nowait())
                    handled = True
                except queue.Empty:
                    break
            stepped = core.has_unfinished_requests()
            if stepped and self._orphaned():  # a busy loop computes for nobody otherwise
                logger.warning("API server is gone; exiting with requests unfinished")
                return
            if stepped:
                step_outputs = core.step()
                self._nothing_to_compute = core.last_step_tokens == 0 and not step_outputs
            else:
                step_outputs = core.poll_transfers() if transfers else []
                self._nothing_to_compute = False
            kv_changed, core.kv_changed = core.kv_changed, False
            if stepped or handled or self._results or kv_changed:
                # Also after inputs alone (an abort of the last request): the server's gauges
                # must see the cache go back to idle.
                self.outputs.put(
                    p.CoreOutputs(
                        outputs=[p.to_wire(o) for o in step_outputs],
                        stats=self._stats(stepped),
                        utility_results=self._results,
                    )
                )
                self._results = []

    def _handle(self, msg: p.CoreInput | None) -> None:
        core = self.core
        if msg is _WAKE:
            return
        if isinstance(msg, p.AddRequest):
            try:
                core.add_request(
                    Request(
                        msg.request_id,
                        p.unpack_ids(msg.prompt_token_ids),
                        msg.sampling_params,
                        msg.eos_token_ids,
                        arrival_time=msg.arrival_time,
                        priority=msg.priority,
                        group_id=msg.group_id,
                        kv_transfer_params=msg.kv_transfer_params,
                    )
                )
            except ValueError as e:  # the server checks first; this is the last line of defence
                logger.warning("rejected request %s: %s", msg.request_id, e)
        elif isinstance(msg, p.AbortRequests):
            core.abort_requests(msg.request_ids)
        elif isinstance(msg, p.UtilityCall):
            self._results.append(self._utility(msg))

    def _utility(self, call: p.UtilityCall) -> p.UtilityResult:
        result: Any = None
        if call.method == "reset_prefix_cache":
            result = self.core.scheduler.reset_prefix_cache()
        elif call.method == "get_load":
            result = self._stats(stepped=False, drain=False)
        elif call.method == "shutdown":
            self.running = False
        else:
            return p.UtilityResult(call.call_id, error=f"unknown utility {call.method!r}")
        return p.UtilityResult(call.call_id, result=result)

    def _stats(self, stepped: bool, drain: bool = True) -> p.EngineStats:
        scheduler = self.core.scheduler
        s = scheduler.make_stats()
        transfers: list[tuple[int, float, str]] = []
        if drain and scheduler.kv_transfer_results:
            transfers = [(r.num_bytes, r.seconds, r.reason) for r in scheduler.kv_transfer_results]
            scheduler.kv_transfer_results = []
        return p.EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            step_tokens=self.core.last_step_tokens if stepped else 0,
            kv_transfers=transfers,
            kv_blocks_leased=s.kv_blocks_leased,
            kv_leases_expired=s.kv_leases_expired,
        )
