"""KV cache events on the wire, in vLLM's format, for the engines that publish them and the
router (or llm-d's KV indexer, or Dynamo's KV router) that reads them.

Each ZMQ PUB message is three frames: the topic, the batch's sequence number (8 bytes,
big-endian, one counter per engine from 0), and a msgpack `KVEventBatch`: an array
`[ts, [event, ...], data_parallel_rank]` whose events are tagged arrays:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Block hashes are `block_hash.external_hash` integers. A subscriber that missed batches sends
the first sequence number it wants (8 bytes, big-endian) to the replay socket (ROUTER) from a
DEALER or REQ socket, and gets `[seq, payload]` for every batch still buffered from there on,
then `[END_SEQ, b""]`.

`--kv-events-config` takes vLLM's JSON (`KVEventsConfig`, the same keys and defaults).
"""

from __future__ import annotations

from typing import Literal

import msgspec

MEDIUM = "GPU"  # vLLM's name for the engine's own KV memory (whatever the device)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay


class BlockStored(msgspec.Struct, array_like=True, tag=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM


class BlockRemoved(msgspec.Struct, array_like=True, tag=True, gc=False):
    block_hashes: list[int]
    medium: str | None = MEDIUM


class AllBlocksCleared(msgspec.Struct, array_like=True, tag=True, gc=False):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `--kv-events-config`: publishing is on with `enable_kv_cache_events` and a
    `zmq` publisher; `endpoint` is bound when it holds a `*` (as vLLM does), else connected."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: zmq when enabled (vLLM's default)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    def __post_init__(self) -> None:
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv-events-config: {name} must be >= 1")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv-events-config: {name} must be a ZMQ address, got {value!r}")


def parse_config(text: str) -> KVEventsConfig:
    """`--kv-events-config`'s JSON; a ValueError naming what is wrong."""
    try:
        return msgspec.json.decode(text.encode(), type=KVEventsConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"--kv-events-config: {e}") from None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes; msgspec.DecodeError (a ValueError) when malformed."""
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    """A sequence-number frame's value; -1 for END_SEQ."""
    return int.from_bytes(frame, "big", signed=True)
