"""Shared helpers of the TCP transport tests: caches, reads, a scriptable fake server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import torch

from baton.kv_transfer.base import TransferResult
from baton.kv_transfer.sockets import KVConnectionPool
from baton.kv_transfer.tcp.reader import read_blocks
from baton.kv_transfer.tcp.server import KVBlockServer
from tests.support.kv_wire import Request, greet, lease_at, read_request

# [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
SHAPE = (12, 2, 2, 4, 2, 8)
ENGINE = "engine-a"
BB = 2 * 2 * 4 * 2 * 8 * 4  # block_bytes of a float32 SHAPE cache


def make_cache(
    dtype: torch.dtype = torch.float32, seed: int = 0, shape: tuple[int, ...] = SHAPE
) -> torch.Tensor:
    """Random bytes (NaNs included, so compare with as_bytes) viewed as dtype."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def deadline(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def read(
    srv: KVBlockServer,
    local: torch.Tensor,
    request_id: str,
    remote_ids: list[int],
    local_ids: list[int],
    engine: str = ENGINE,
    seconds: float = 5.0,
    pool: KVConnectionPool | None = None,
) -> TransferResult:
    return read_blocks(
        lease_at(srv.port, engine, request_id),
        remote_ids,
        local,
        local_ids,
        deadline(seconds),
        pool=pool,
    )


def wait_done(srv: KVBlockServer, timeout: float = 2.0) -> list[str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done = srv.leases.claimed()
        if done:
            return done
        time.sleep(0.005)
    return []


def fake_server(behave: Callable[[Request], None]) -> tuple[int, threading.Thread]:
    """One-connection server that greets, parses the request, then runs behave(request)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def run() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                behave(read_request(conn, greet(conn)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return port, thread
