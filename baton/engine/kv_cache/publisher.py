"""Publishes the engine's KV cache events over ZMQ, in vLLM's format (`baton.kv_events`).

The EngineCore calls `publish` once per step; it never blocks the step. A daemon thread owns
both sockets: it encodes and sends each batch on the PUB socket, keeps the last
`buffer_steps` batches, and answers replay requests from them on the ROUTER socket.

Sequence numbers are given at `publish`, in the engine's thread: a batch dropped because the
queue was full leaves a gap that subscribers see, rather than a silent hole in their index.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections import deque

import zmq

from baton.kv_events import (
    END_SEQ,
    KVCacheEvent,
    KVEventBatch,
    KVEventsConfig,
    encode_batch,
    seq_bytes,
    seq_of,
)

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05  # how long the thread waits for a batch before looking at replay requests


class KVEventPublisher:
    """A PUB socket for the event batches and a ROUTER socket that replays the recent ones.

    `endpoint` is bound when it holds a `*` or is an ipc/inproc address (as vLLM), and also
    when its host is an address of this machine (`tcp://127.0.0.1:5557`, the pod's IP: Baton's
    router subscribes to the engine, and the engine need not listen on every interface); else
    it is connected (vLLM's collector mode: a connected PUB pushes to a collector that binds,
    as llm-d's KV indexer does). `replay_endpoint`, when set, is always bound.
    """

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._dropping = False  # the queue overflowed; logged once until it drains
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        # Made and bound here, so that an address in use fails the engine's start; the thread
        # owns them from its start on (the thread's start is the barrier ZMQ asks for).
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        endpoint = config.endpoint
        try:
            _bind_or_connect(self._pub, endpoint)
            if config.replay_endpoint is not None:
                endpoint = config.replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv-events-config: cannot open {endpoint!r}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queues one batch for the thread; never blocks. A full queue drops the batch (its
        sequence number is spent: subscribers see the gap)."""
        seq = self._next_seq
        self._next_seq += 1
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        try:
            self._queue.put_nowait((seq, batch))
            self._dropping = False
        except queue.Full:
            if not self._dropping:
                self._dropping = True
                logger.warning(
                    "KV events queue full (max_queue_size %d): dropping batches from seq %d",
                    self.config.max_queue_size,
                    seq,
                )

    def shutdown(self, timeout: float = 2.0) -> None:
        """Sends what is queued (for at most `timeout` seconds), then closes the sockets; a
        second call does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the KV events thread did not stop within %.1f s", timeout)
            return  # it still owns the sockets; the daemon thread dies with the process
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            self._serve_replays()
            try:
                seq, batch = self._queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            self._send(seq, batch)

    def _send(self, seq: int, batch: KVEventBatch) -> None:
        payload = encode_batch(batch)
        self._buffer.append((seq, payload))
        # A PUB socket never blocks: past the high-water mark it drops, and the subscriber
        # replays what it missed from the buffer.
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload))

    def _serve_replays(self) -> None:
        """Answers every waiting replay request: `[identity, b"", start_seq]` gets each buffered
        batch from `start_seq` on as `[identity, b"", seq, payload]`, then END_SEQ."""
        sock = self._replay
        if sock is None:
            return
        while sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning(
                    "ignoring a malformed KV events replay request (%d frames)", len(frames)
                )
                continue
            identity, _, start = frames
            start_seq = seq_of(start)
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    sock.send_multipart((identity, b"", seq_bytes(seq), payload))
            sock.send_multipart((identity, b"", END_SEQ, b""))


def _bind_or_connect(sock: zmq.Socket[bytes], endpoint: str) -> None:
    if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
        return
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        # Not an address of this machine (EADDRNOTAVAIL), or a host name (ENODEV): a collector
        # elsewhere binds it. An address in use here is still an error.
        if e.errno not in (errno.EADDRNOTAVAIL, errno.ENODEV):
            raise
        sock.connect(endpoint)
