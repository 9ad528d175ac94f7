"""The router's subscriptions to the engines' KV events (vLLM's format, `baton.kv_events`).

An engine says in /health where it publishes (`kv_events`: endpoint, replay endpoint, topic,
block size, hash scheme); the router takes only the ports from it and connects to the engine's
own host, so nothing an engine (let alone a client) says makes the router connect elsewhere.

Per engine, one task reads the PUB stream and keeps the index in step:
- at start it asks the replay socket for every batch still buffered (from sequence 0): an engine
  that has run for a while is indexed at once, and a batch published before the subscription
  took effect (ZMQ's slow joiner) is not lost;
- a batch past the next expected number is a gap: the missing ones are replayed first;
- a batch before it is either one already applied (a replay overlapped the stream: its
  timestamp is not newer than the last applied) or an engine that restarted and numbers from 0
  again: its entries are dropped and its history replayed;
- a reconnection (the engine went away and something listens on its port again) rebuilds the
  engine's entries from its replay buffer: a restarted engine's first batches may have passed
  before the subscription was back;
- a gap the replay buffer no longer covers drops the engine's entries and rebuilds from what
  is left (counted in `resyncs`): the index may then miss blocks, never invent them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from baton.block_hash import HASH_SCHEME
from baton.kv_events import KVEventBatch, decode_batch, seq_bytes, seq_of
from baton.router.kv_index import KVIndex

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT = 2.0  # seconds to wait for each replayed batch
RETRY_SECONDS = 1.0  # before resubscribing after an error


@dataclass(frozen=True)
class EventSource:
    """Where one engine publishes, as the router connects to it."""

    endpoint: str  # tcp://engine-host:port
    replay_endpoint: str | None
    topic: str
    block_size: int
    instance: str | None = None  # the engine process: another one numbers from 0 again


def source_of(engine_url: str, health: dict[str, Any]) -> EventSource | None:
    """The engine's event source from its /health answer; None when it publishes none (or
    says so in a way the router cannot use: another hash scheme, a non-TCP endpoint)."""
    info = health.get("kv_events")
    if not isinstance(info, dict) or info.get("hash") != HASH_SCHEME:
        return None
    host = urlsplit(engine_url).hostname
    block_size = info.get("block_size")
    topic = info.get("topic", "")
    if not host or not isinstance(block_size, int) or block_size < 1 or not isinstance(topic, str):
        return None
    if ":" in host:
        host = f"[{host}]"
    endpoint = _on_host(info.get("endpoint"), host)
    if endpoint is None:
        return None
    replay = _on_host(info.get("replay_endpoint"), host)
    instance = info.get("instance")
    instance = instance[:64] if isinstance(instance, str) else None
    return EventSource(endpoint, replay, topic, block_size, instance)


def _on_host(address: object, host: str) -> str | None:
    """`tcp://anything:PORT` as `tcp://host:PORT`; None for anything else."""
    if not isinstance(address, str) or not address.startswith("tcp://"):
        return None
    port = address.rsplit(":", 1)[-1]
    if not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return f"tcp://{host}:{int(port)}"


class Subscription:
    """One engine's events, applied to `index` under the engine's URL."""

    def __init__(self, index: KVIndex, engine: str, source: EventSource) -> None:
        self.index = index
        self.engine = engine
        self.source = source
        self.expected = 0  # the next sequence number to apply
        self.last_ts = 0.0  # the last applied batch's timestamp
        self.synced = False  # the history has been replayed (or there is no replay socket)
        self.batches = self.gaps = self.restarts = self.reconnects = self.resyncs = 0
        self.last_event: float | None = None  # time.monotonic() of the last applied batch
        self._ctx = zmq.asyncio.Context.instance()
        self.task = asyncio.create_task(self._run(), name=f"kv-events {engine}")

    def describe(self) -> dict[str, Any]:
        return {
            "endpoint": self.source.endpoint,
            "synced": self.synced,
            "next_seq": self.expected,
            "batches": self.batches,
            "gaps": self.gaps,
            "restarts": self.restarts,
            "reconnects": self.reconnects,
            "resyncs": self.resyncs,
            "blocks": self.index.num_blocks(self.engine),
            "last_event_age_s": None
            if self.last_event is None
            else round(time.monotonic() - self.last_event, 3),
        }

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.index.forget(self.engine)

    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("KV events of %s failed; resubscribing", self.engine)
            await asyncio.sleep(RETRY_SECONDS)

    async def _follow(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        connects = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(self.source.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(connects, zmq.POLLIN)
        handshakes = 0
        try:
            await self._replay()
            self.synced = True
            while True:
                ready = dict(await poller.poll())
                if connects in ready:
                    await connects.recv_multipart()
                    handshakes += 1
                    if handshakes > 1:  # the first is this subscription's own
                        await self._reconnected()
                if sub in ready:
                    frames = await sub.recv_multipart()
                    batch = self._decode(frames[2]) if len(frames) == 3 else None
                    if batch is not None:
                        await self._on_batch(seq_of(frames[1]), batch)
        finally:
            sub.disable_monitor()
            connects.close()
            sub.close()

    async def _reconnected(self) -> None:
        """The connection was lost and is back: whatever happened meanwhile (another process
        on the port, whose first batches passed unseen), the replay buffer tells it all."""
        logger.info("engine %s: KV events reconnected; reindexing from its buffer", self.engine)
        self.reconnects += 1
        self._reset()
        await self._replay()

    async def _on_batch(self, seq: int, batch: KVEventBatch) -> None:
        if seq < self.expected:
            if batch.ts <= self.last_ts:
                return  # applied already, from a replay
            logger.info("engine %s restarted its KV events; reindexing", self.engine)
            self.restarts += 1
            self._reset()
        if seq > self.expected:
            self.gaps += 1
            await self._replay()
            if seq < self.expected:
                return
        if seq > self.expected:  # still missing: the replay buffer has moved past them
            self.resyncs += 1
            self._reset()
        self._apply(seq, batch)

    async def _replay(self) -> None:
        """Applies the buffered batches from `expected` on."""
        if self.source.replay_endpoint is None:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.source.replay_endpoint)
        try:
            await dealer.send_multipart([b"", seq_bytes(self.expected)])
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT * 1000):
                    logger.warning("replay of %s's KV events timed out", self.engine)
                    return
                frames = await dealer.recv_multipart()
                if len(frames) < 2:
                    continue
                seq = seq_of(frames[-2])
                if seq < 0:
                    return
                batch = self._decode(frames[-1])
                if batch is None or seq < self.expected:
                    continue
                if seq > self.expected:
                    self.resyncs += 1
                    self._reset()
                self._apply(seq, batch)
        finally:
            dealer.close()

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        self.index.apply(self.engine, batch.events)
        self.expected = seq + 1
        self.last_ts = max(self.last_ts, batch.ts)
        self.batches += 1
        self.last_event = time.monotonic()

    def _reset(self) -> None:
        self.index.forget(self.engine)
        self.expected = 0
        self.last_ts = 0.0

    def _decode(self, payload: bytes) -> KVEventBatch | None:
        try:
            return decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("a malformed KV event batch from %s: %s", self.engine, e)
            return None


class Subscriptions:
    """The router's subscriptions, one per engine that publishes; in step with /health."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self._subs: dict[str, Subscription] = {}

    def sync(self, engine: str, health: dict[str, Any]) -> None:
        """Subscribes to `engine` as its /health answer says (again, from scratch, if its
        source changed: another port, or another process; stops if it publishes no longer)."""
        source = source_of(engine, health)
        current = self._subs.get(engine)
        if current is not None and current.source == source:
            return
        if current is not None:
            self.stop(engine)
        if source is not None:
            logger.info("engine %s: following its KV events at %s", engine, source.endpoint)
            self._subs[engine] = Subscription(self.index, engine, source)

    def stop(self, engine: str) -> None:
        sub = self._subs.pop(engine, None)
        if sub is not None:
            sub.task.cancel()
            self.index.forget(engine)

    def block_size(self, engine: str) -> int | None:
        """The engine's block size when its events are followed and synced (exact mode)."""
        sub = self._subs.get(engine)
        return sub.source.block_size if sub is not None and sub.synced else None

    def describe(self, engine: str) -> dict[str, Any] | None:
        sub = self._subs.get(engine)
        return None if sub is None else sub.describe()

    async def close(self) -> None:
        subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            await sub.close()
