"""KV transfer benchmark: GB/s of the TCP and NIXL block transports between two processes.

Moves 1, 16, 256 and 4096 blocks of the ``small`` model's KV cache (4 layers, 4 KV heads, head_dim
32, block 16, float32: 64 KiB per block) from a block server in a spawned child process into this
process, and prints it beside (a) a raw loopback socket send of the same bytes (one ``sendall`` of a
buffer into ``recv_into`` calls, same two processes) and (b) a memcpy of the same bytes (torch
``copy_``), as ratios. Each size is timed cold (a new connection per transfer, for both the
transport and the raw socket) and warm (the transport through a ``KVConnectionPool``, the raw
socket over one already-open connection). Also reports the cost of the checksum (xxh3-64)
beside zlib's crc32.
Aim (issue 4): TCP >= 0.8x the raw socket for transfers of 1 MiB and more.

A third table times TCP staged through host buffers (``--kv-staging always``: the path a KV cache
in device memory takes, here with host memory on both sides) against the direct TCP path, warm,
at 1, 16 and 64 MiB, interleaved in the same run, as a ratio (issue 16).

Where a NIXL package imports, a second table times ``NixlTransport.read`` (side-channel lookup,
one READ of the coalesced regions, the checksum of every received block, DONE) with the remote agent
already known, beside the bare NIXL READ of the same bytes and the same memcpy, as ratios. UCX
picks its transports from the environment (``UCX_TLS``; shared memory between two processes here).
Aim (issue 4): NIXL over shared memory >= 0.8x memcpy.

    python bench/kv_transfer.py [--json out/kv_transfer.json]
    python bench/kv_transfer.py --sizes 1 4 16 --tcp-only --modes warm --interleave

``--sizes`` (MiB) replaces the main table's sizes; ``--tcp-only`` leaves out the staged and NIXL
tables; ``--interleave`` alternates a TCP read and a raw read in one loop (both see the same
machine state; without it all TCP reads run before all raw reads, as in docs/benchmarks.md);
``--pin SERVER:READER`` pins the two processes to CPUs; ``--scatter`` reads the blocks in
descending order, each a run of its own.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.kv_transfer.base import KVTransferConfig, LoadSpec
from baton.kv_transfer.checksum import block_bytes, block_checksum
from baton.kv_transfer.keyring import SECRET_ENV, KeyRing, new_secret
from baton.kv_transfer.nixl.channel import paired_runs
from baton.kv_transfer.params import RemotePrefill
from baton.kv_transfer.sockets import KVConnectionPool
from baton.kv_transfer.tcp.reader import Lease, read_blocks
from baton.kv_transfer.tcp.server import KVBlockServer
from baton.kv_transfer.tcp.staging import StagingPool

try:
    from baton.kv_transfer.nixl.transport import NixlTransport
except ImportError as exc:  # the NIXL table is left out
    NixlTransport = None  # type: ignore[assignment,misc]
    NIXL_MISSING = str(exc)

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 4, 32, 16
NUM_BLOCKS = 4096
SIZES = (1, 16, 256, 4096)
# Repeats per size: enough transfers to be timed well, few enough to finish in well under a minute.
REPEATS = {1: 300, 16: 200, 256: 30, 4096: 5}
ENGINE = "bench-engine"
STAGED_SIZES = (16, 256, 1024)  # 1, 16 and 64 MiB
STAGED_REPEATS = {16: 100, 256: 20, 1024: 8}
# The hand-off secret of this run, shared with the serving child through the environment.
os.environ.setdefault(SECRET_ENV, new_secret())


def repeats(n: int) -> int:
    """Transfers timed for n blocks."""
    return REPEATS.get(n, max(5, min(300, 4800 // n)))


def make_cache() -> torch.Tensor:
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    return torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)


def _child(port_q: Any, stop: Any, sizes: tuple[int, ...], cpus: set[int] | None) -> None:
    """Block server plus a raw socket server over the same cache, until stop is set."""
    if cpus:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
    cache = make_cache()
    keys = KeyRing.load()
    srv = KVBlockServer(cache, ENGINE, keys)
    for n in sizes:
        for mode in ("cold", "warm"):
            for i in range(repeats(n) + 1):  # +1 for the warm-up read
                srv.leases.lease(f"{mode}-{n}-{i}", list(range(n)), time.time() + 600)
    kv_port = srv.start()
    staging = StagingPool(cache)
    staged = KVBlockServer(cache, ENGINE, keys, staging=staging)
    for n in STAGED_SIZES:
        for i in range(STAGED_REPEATS[n] + 1):
            srv.leases.lease(f"direct-{n}-{i}", list(range(n)), time.time() + 600)
            staged.leases.lease(f"staged-{n}-{i}", list(range(n)), time.time() + 600)
    staged_port = staged.start()
    raw = socket.create_server(("127.0.0.1", 0))
    raw.settimeout(0.1)
    nixl = None
    if NixlTransport is not None:
        nixl = NixlTransport(KVTransferConfig(role="prefill", transport="nixl"), keys)
        nixl_port = nixl.start(cache)
        for n in SIZES:
            for i in range(REPEATS[n] + 1):
                nixl.lease(f"nixl-{n}-{i}", list(range(n)), time.time() + 600)
    nixl_peer = (nixl_port, nixl.config.engine_id) if nixl is not None else None
    port_q.put((kv_port, raw.getsockname()[1], nixl_peer, staged_port))
    flat = memoryview(cache.view(-1).view(torch.uint8).numpy().data)
    while not stop.is_set():
        try:
            conn, _ = raw.accept()
        except TimeoutError:
            continue
        with conn:  # serves transfers on this connection until the client closes it
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while len(head := conn.recv(8, socket.MSG_WAITALL)) == 8:
                (nbytes,) = struct.unpack("!Q", head)
                conn.sendall(flat[:nbytes])
                conn.recv(1)
    raw.close()
    srv.stop()
    staged.stop()
    staging.close()
    if nixl is not None:
        nixl.stop()


def raw_connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def raw_read(sock: socket.socket, view: memoryview) -> None:
    sock.sendall(struct.pack("!Q", len(view)))
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("raw server closed early")
        got += k
    sock.sendall(b"\x01")


def timed(fn: Any, count: int) -> float:
    """Median seconds of fn() over count calls, after one warm-up."""
    fn(-1)
    times = []
    for i in range(count):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def checksum_cost(nbytes: int) -> dict[str, float]:
    buf = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy().data)
    out = {}
    for name, fn in (("xxh3", block_checksum), ("crc32", zlib.crc32)):
        fn(buf)
        start = time.perf_counter()
        fn(buf)
        out[name + "_gbps"] = nbytes / (time.perf_counter() - start) / 1e9
    return out


def measure(
    n: int,
    mode: str,
    kv_port: int,
    raw_port: int,
    local: torch.Tensor,
    src: torch.Tensor,
    flat: memoryview,
    interleave: bool = False,
    scatter: bool = False,
) -> dict[str, Any]:
    """One row: n blocks over new connections (cold) or over one kept open (warm); with
    ``scatter``, in descending order, so that every block is a run of its own on both sides."""
    nbytes = n * block_bytes(local)
    ids = list(range(n))[::-1] if scatter else list(range(n))
    pool = KVConnectionPool() if mode == "warm" else None
    keys = KeyRing.load()
    raw_sock = raw_connect(raw_port) if mode == "warm" else None

    def kv(i: int) -> None:
        rid = f"{mode}-{n}-{i + 1}"
        lease = Lease("127.0.0.1", kv_port, ENGINE, rid, keys, keys.signing_key_id)
        res = read_blocks(lease, ids, local, ids, time.monotonic() + 30, pool=pool)
        if not res.ok:
            raise RuntimeError(res.error)

    def raw(i: int) -> None:
        if raw_sock is not None:
            raw_read(raw_sock, flat[:nbytes])
        else:
            with raw_connect(raw_port) as sock:
                raw_read(sock, flat[:nbytes])

    def memcpy(i: int) -> None:
        local[:n].copy_(src[:n])

    def both(count: int) -> tuple[float, float]:
        """Median seconds of kv and of raw, alternating."""
        kv(-1)
        raw(-1)
        t: dict[Any, list[float]] = {kv: [], raw: []}
        for i in range(count):
            for fn in (kv, raw):
                start = time.perf_counter()
                fn(i)
                t[fn].append(time.perf_counter() - start)
        return tuple(sorted(v)[len(v) // 2] for v in t.values())  # type: ignore[return-value]

    try:
        if interleave:
            t_kv, t_raw = both(repeats(n))
        else:
            t_kv = timed(kv, repeats(n))
            t_raw = timed(raw, repeats(n))
    finally:
        if pool is not None:
            pool.close()
        if raw_sock is not None:
            raw_sock.close()  # before the next row: the raw server serves one connection at a time
    t_mem = timed(memcpy, repeats(n))
    return {
        "blocks": n,
        "bytes": nbytes,
        "mode": mode,
        "tcp_gbps": nbytes / t_kv / 1e9,
        "raw_socket_gbps": nbytes / t_raw / 1e9,
        "memcpy_gbps": nbytes / t_mem / 1e9,
        "tcp_vs_raw": t_raw / t_kv,
        "tcp_vs_memcpy": t_mem / t_kv,
        "tcp_median_s": t_kv,
    }


def measure_staged(n: int, kv_port: int, staged_port: int, local: torch.Tensor) -> dict[str, Any]:
    """Direct against staged TCP reads of n blocks, warm, alternating so that both see the same
    machine state."""
    nbytes = n * block_bytes(local)
    ids = list(range(n))
    keys = KeyRing.load()
    staging = StagingPool(local)
    times: dict[str, list[float]] = {"direct": [], "staged": []}
    with KVConnectionPool() as pool:
        for i in range(STAGED_REPEATS[n] + 1):
            for kind, port in (("direct", kv_port), ("staged", staged_port)):
                lease = Lease(
                    "127.0.0.1", port, ENGINE, f"{kind}-{n}-{i}", keys, keys.signing_key_id
                )
                start = time.perf_counter()
                res = read_blocks(
                    lease,
                    ids,
                    local,
                    ids,
                    time.monotonic() + 30,
                    pool=pool,
                    staging=staging if kind == "staged" else None,
                )
                if not res.ok:
                    raise RuntimeError(res.error)
                if i:  # the first read of each is the warm-up
                    times[kind].append(time.perf_counter() - start)
    staging.close()
    t_direct, t_staged = (sorted(t)[len(t) // 2] for t in (times["direct"], times["staged"]))
    return {
        "blocks": n,
        "bytes": nbytes,
        "direct_gbps": nbytes / t_direct / 1e9,
        "staged_gbps": nbytes / t_staged / 1e9,
        "staged_vs_direct": t_direct / t_staged,
    }


def measure_nixl(
    n: int, reader: Any, peer: tuple[int, str], local: torch.Tensor, src: torch.Tensor
) -> dict[str, Any]:
    """One row: n blocks through NixlTransport.read, and the bare NIXL READ of the same bytes."""
    nbytes = n * block_bytes(local)
    ids = list(range(n))
    port, engine = peer

    def kv(i: int) -> None:
        rid = f"nixl-{n}-{i + 1}"
        expires = time.time() + 60
        remote = RemotePrefill(
            engine,
            "127.0.0.1",
            port,
            rid,
            ids,
            n * BLOCK_SIZE,
            expires,
            key_id=reader.keys.signing_key_id,
        )
        res = reader.read(LoadSpec(rid, remote, ids, ids, 30.0), time.monotonic() + 30)
        if not res.ok:
            raise RuntimeError(res.error)

    def bare(i: int) -> None:
        # The transport's own READ step alone: no lookup, no checksum, no DONE.
        the_peer = reader._peers[("127.0.0.1", port)]
        error = reader._transfer(
            the_peer, paired_runs(ids, ids), block_bytes(local), time.monotonic() + 30
        )
        if error is not None:
            raise RuntimeError(error)

    def memcpy(i: int) -> None:
        local[:n].copy_(src[:n])

    t_kv = timed(kv, REPEATS[n])
    t_bare = timed(bare, REPEATS[n])
    t_mem = timed(memcpy, REPEATS[n])
    return {
        "blocks": n,
        "bytes": nbytes,
        "nixl_gbps": nbytes / t_kv / 1e9,
        "nixl_read_only_gbps": nbytes / t_bare / 1e9,
        "memcpy_gbps": nbytes / t_mem / 1e9,
        "nixl_vs_memcpy": t_mem / t_kv,
        "nixl_read_only_vs_memcpy": t_mem / t_bare,
        "nixl_median_s": t_kv,
    }


def _cpu_pair(text: str) -> tuple[set[int], set[int]]:
    server, reader = text.split(":")
    return {int(c) for c in server.split(",")}, {int(c) for c in reader.split(",")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--sizes", type=float, nargs="+", metavar="MIB", help="the main table's sizes, in MiB"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=("cold", "warm"), default=["cold", "warm"], help="rows"
    )
    parser.add_argument(
        "--tcp-only", action="store_true", help="leave out the staged and NIXL tables"
    )
    parser.add_argument(
        "--interleave", action="store_true", help="alternate TCP and raw reads in one loop"
    )
    parser.add_argument(
        "--scatter",
        action="store_true",
        help="read the blocks in descending order, each a run of its own (a long-running "
        "engine's blocks are rarely consecutive); the raw socket moves the same bytes",
    )
    parser.add_argument(
        "--pin",
        type=_cpu_pair,
        metavar="SERVER:READER",
        help="pin the serving process and the reader to these CPUs (e.g. 0:1): each side a "
        "host of its own, rather than wherever the scheduler puts them per read",
    )
    args = parser.parse_args()
    server_cpus, reader_cpus = args.pin if args.pin else (None, None)
    bpb = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
    sizes = tuple(max(1, round(m * 2**20 / bpb)) for m in args.sizes) if args.sizes else SIZES

    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_child, args=(port_q, stop, sizes, server_cpus), daemon=True)
    child.start()
    if reader_cpus:
        os.sched_setaffinity(0, reader_cpus)
        torch.set_num_threads(len(reader_cpus))  # the memcpy column's threads on the reader's CPUs
    rows: list[dict[str, Any]] = []
    nixl_rows: list[dict[str, Any]] = []
    staged_rows: list[dict[str, Any]] = []
    reader = None
    try:
        kv_port, raw_port, nixl_peer, staged_port = port_q.get(timeout=60)
        local = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        src = make_cache()
        flat = memoryview(local.view(-1).view(torch.uint8).numpy().data)
        for n in sizes:
            for mode in args.modes:
                rows.append(
                    measure(
                        n, mode, kv_port, raw_port, local, src, flat, args.interleave, args.scatter
                    )
                )
        for n in () if args.tcp_only else STAGED_SIZES:
            staged_rows.append(measure_staged(n, kv_port, staged_port, local))
        if nixl_peer is not None and not args.tcp_only:
            reader = NixlTransport(
                KVTransferConfig(role="decode", transport="nixl"), KeyRing.load()
            )
            reader.start(local)
            for n in SIZES:
                nixl_rows.append(measure_nixl(n, reader, nixl_peer, local, src))
    finally:
        if reader is not None:
            reader.stop()
        stop.set()
        child.join(10)
        if child.is_alive():
            child.kill()

    cost = checksum_cost(NUM_BLOCKS * bpb)
    print(
        f"{'blocks':>6} {'MiB':>8} {'conn':>5} {'tcp GB/s':>9} {'raw GB/s':>9} {'memcpy GB/s':>11} "
        f"{'tcp/raw':>8} {'tcp/memcpy':>10}"
    )
    for r in rows:
        print(
            f"{r['blocks']:>6} {r['bytes'] / 2**20:>8.3f} {r['mode']:>5} {r['tcp_gbps']:>9.2f} "
            f"{r['raw_socket_gbps']:>9.2f} {r['memcpy_gbps']:>11.2f} {r['tcp_vs_raw']:>8.2f} "
            f"{r['tcp_vs_memcpy']:>10.2f}"
        )
    print(f"checksum: xxh3 {cost['xxh3_gbps']:.2f} GB/s (zlib crc32 {cost['crc32_gbps']:.2f} GB/s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {"rows": rows, "nixl_rows": nixl_rows, "staged_rows": staged_rows, "checksum": cost}
        args.json.write_text(json.dumps(out, indent=2))
    if args.tcp_only:
        return
    print("\nTCP staged through host buffers (both sides) against direct, warm")
    print(f"{'blocks':>6} {'MiB':>8} {'direct GB/s':>11} {'staged GB/s':>11} {'staged/direct':>13}")
    for r in staged_rows:
        print(
            f"{r['blocks']:>6} {r['bytes'] / 2**20:>8.3f} {r['direct_gbps']:>11.2f} "
            f"{r['staged_gbps']:>11.2f} {r['staged_vs_direct']:>13.2f}"
        )
    if nixl_rows:
        print(f"\nNIXL (UCX_TLS={os.environ.get('UCX_TLS', 'UCX default')})")
        print(
            f"{'blocks':>6} {'MiB':>8} {'nixl GB/s':>10} {'READ GB/s':>10} {'memcpy GB/s':>11} "
            f"{'nixl/memcpy':>11} {'READ/memcpy':>11}"
        )
        for r in nixl_rows:
            print(
                f"{r['blocks']:>6} {r['bytes'] / 2**20:>8.3f} {r['nixl_gbps']:>10.2f} "
                f"{r['nixl_read_only_gbps']:>10.2f} {r['memcpy_gbps']:>11.2f} "
                f"{r['nixl_vs_memcpy']:>11.2f} {r['nixl_read_only_vs_memcpy']:>11.2f}"
            )
    else:
        print(f"\nNIXL left out: {NIXL_MISSING}")


if __name__ == "__main__":
    main()
