"""A KV events subscriber written from vLLM's published format, not from Baton's code: frames
`[topic, seq (8 bytes, big-endian), msgpack payload]`, the payload decoded with plain msgpack
into lists and read by position, and the replay protocol (`[b"", start_seq]` to a ROUTER socket,
answered by `[b"", seq, payload]` frames and an end marker of seq -1)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

END = -1  # vLLM's replay end marker, as a signed sequence number


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def decode(payload: bytes) -> tuple[float, list[list[Any]], int | None]:
    """vLLM's KVEventBatch: [ts, [event, ...], data_parallel_rank], each event a tagged array."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    return ts, events, rank


def apply(index: set[int], payload: bytes, block_size: int) -> list[str]:
    """Applies one batch to `index` (the block hashes the engine holds); returns its tags."""
    _, events, rank = decode(payload)
    assert rank == 0
    for event in events:
        tag = event[0]
        if tag == "BlockStored":  # [tag, block_hashes, parent, token_ids, block_size, lora, medium]
            hashes, parent, token_ids, size = event[1:5]
            assert size == block_size and len(token_ids) == len(hashes) * block_size
            assert parent is None or isinstance(parent, int)
            index.update(hashes)
        elif tag == "BlockRemoved":  # [tag, block_hashes, medium]
            index.difference_update(event[1])
        elif tag == "AllBlocksCleared":
            index.clear()
        else:
            raise AssertionError(f"unknown event {tag!r}")
    return [e[0] for e in events]


class Subscriber:
    """A SUB socket on the events and a DEALER on the replay socket, on 127.0.0.1."""

    def __init__(self, ctx: zmq.Context[Any], port: int, replay_port: int, topic: bytes) -> None:
        self.topic = topic
        self.sub = ctx.socket(zmq.SUB)
        monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        # Generous: under a full suite on two cores, 5 s was once not enough.
        assert monitor.poll(30_000), "the SUB socket did not connect"
        self.sub.disable_monitor()
        monitor.close(linger=0)
        time.sleep(0.1)  # the subscription travels to the publisher after the handshake
        self.replay_sock = ctx.socket(zmq.DEALER)
        self.replay_sock.connect(f"tcp://127.0.0.1:{replay_port}")

    def recv(self, timeout_ms: int = 5000) -> tuple[int, bytes] | None:
        """The next published batch as (seq, payload); None if none came in time."""
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic
        return seq_of(seq), payload

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every batch the publisher still buffers from seq `start` on."""
        self.replay_sock.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[tuple[int, bytes]] = []
        while True:
            assert self.replay_sock.poll(5000), "no answer from the replay socket"
            empty, seq, payload = self.replay_sock.recv_multipart()
            assert empty == b""
            if seq_of(seq) == END:
                assert payload == b""
                return got
            got.append((seq_of(seq), payload))

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay_sock.close(linger=0)
