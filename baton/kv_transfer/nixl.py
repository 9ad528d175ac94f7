"""NIXL transport for paged KV blocks: the decode side READs leased blocks straight out of the
prefill engine's registered KV tensor (UCX backend: shared memory between processes on one host,
TCP or RDMA across hosts, GPU memory where the tensor is on CUDA).

Each engine registers its whole KV tensor ``[num_blocks, ...]`` with one NIXL agent once and runs a
small side channel, a TCP socket on ``config.host:config.port``; its port is the ``remote_port``
readers are given. Messages are length-prefixed msgpack structs (below). A read:

    reader -> server  Hello (first contact with an address): the server's engine id, its agent
                      metadata and its tensor's base address, number of blocks and block bytes;
                      the reader adds the remote agent and caches it per (host, port, engine id)
    reader -> server  Lookup: engine id, request id, block ids, block bytes and how long the read
                      may take; the server checks the lease like ``tcp.Status`` and answers the
                      per-block checksums it computed when the lease was made
    reader            NIXL READs of the coalesced regions into its own blocks, 16 MiB at a time,
                      polled until done or the deadline; each chunk's blocks are checksummed on a
                      second thread while the next chunk is READ, and compared with the server's
    reader -> server  Done (one way): the server drops the lease and reports it claimed

DONE and release travel on the side channel rather than as NIXL notifications: a release needs
no NIXL connection at all (a decode engine may release a lease of an engine it never read from),
the server gets it from the socket thread it already has instead of polling the agent from the
engine's busy loop, and a release is answered, so its failure is visible like TCP's.

A lease being read is never expired under the read: a Lookup holds it for the reader's time left
(at most 30 s) or until its Done or release. The agent runs without NIXL's progress
thread, which spins a core at 100% even when idle; readers drive their own transfers by polling,
and the server polls its agent only while a hold is active, which transports without one-sided
hardware support (UCX over TCP) need to make progress. UCX is created with
``ucx_error_handling_mode: none``, which shared memory needs; ``UCX_TLS`` (e.g. ``self,sm`` on one
host) and ``UCX_NET_DEVICES`` are left to the deployment.

Importing this module raises ImportError when no NIXL package (``nixl``, ``nixl-cu12``,
``nixl-cu13``) can be imported, so that ``make_transport`` falls back to TCP.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from baton.kv_transfer.base import KVTransferConfig, LoadSpec, RemotePrefill, TransferResult
from baton.kv_transfer.checksum import block_bytes, block_crcs
from baton.kv_transfer.leases import LeaseTable, Status
from baton.kv_transfer.nixl_channel import (
    Done,
    Hello,
    Lookup,
    Message,
    Release,
    Reply,
    message_decoder,
    paired_runs,
    recv_frame,
    reply_decoder,
    send_message,
    split_runs,
)
from baton.kv_transfer.tcp import _is_timeout, _set_io_timeout
from baton.kv_transfer.tcp_reader import KVConnectionPool

logger = logging.getLogger(__name__)


def _import_nixl() -> Any:
    """The NIXL Python API module; ``nixl_cu12._api`` first, as it imports without torch/CUDA."""
    errors = []
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except (ImportError, OSError) as exc:  # OSError: a native library failed to load
            errors.append(f"{name}: {exc}")
    raise ImportError("no usable NIXL package (nixl, nixl-cu12, nixl-cu13): " + "; ".join(errors))


_nixl = _import_nixl()

_ACCEPT_POLL_S = 0.05  # bounds how long stop() waits for the accept loop
_PROGRESS_POLL_S = 0.0002  # server-side progress while a read holds a lease
_READ_POLL_S = 0.00002  # reader's pause between transfer-state polls, to let other threads run
# Bytes per READ: the reader checksums one chunk on its verify thread while NIXL copies the next
# (it releases the GIL during the copy). On an idle two-core machine 4-16 MiB chunks READ and
# checked 256 MiB at 1.8x the rate of one READ followed by the checksum pass; on a busy one they
# tie. Reads of one chunk or less are checked inline, without the thread hop.
_CHUNK_BYTES = 16 << 20


# ---- memory helpers ---------------------------------------------------------------------------


def _mem(kv_cache: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of the tensor."""
    if kv_cache.device.type == "cuda":
        return "VRAM", kv_cache.get_device()
    return "DRAM", 0


@dataclass(frozen=True)
class _Peer:
    """A remote engine as the reader knows it after Hello."""

    engine_id: str
    agent_name: str
    base_addr: int
    num_blocks: int
    block_bytes: int
    mem_type: str
    device_id: int


class NixlTransport:
    """The `KVTransport` over NIXL; see the module docstring."""

    name = "nixl"

    def __init__(self, config: KVTransferConfig, *, io_timeout: float = 30.0) -> None:
        self.config = config
        self._io_timeout = io_timeout  # a stalled side-channel peer must not pin a server thread
        self._agent: Any = None
        self._reg: Any = None
        self._kv: torch.Tensor | None = None
        self._leases: LeaseTable | None = None
        self._hello: Reply | None = None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._reads_ended = threading.Condition(self._lock)
        self._num_reading = 0  # reads in progress; stop() lets them end before deregistering
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._pool = KVConnectionPool()
        # One thread checksums received chunks while the loader READs the next (a second core).
        self._verify = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-nixl-verify")

    # ------------------------------------------------------------------ lifecycle

    def start(self, kv_cache: torch.Tensor) -> int:
        if not kv_cache.is_contiguous() or kv_cache.dim() < 1:
            raise ValueError(f"kv_cache must be one contiguous tensor, got {tuple(kv_cache.shape)}")
        config = _nixl.nixl_agent_config(
            enable_prog_thread=False,
            backends=[],
            sync_mode=_nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        name = f"baton-{self.config.engine_id}-{self.config.rank}"  # one agent per rank
        self._agent = _nixl.nixl_agent(name, config)
        self._agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        self._reg = self._agent.register_memory(kv_cache)
        self._kv = kv_cache
        mem_type, device_id = _mem(kv_cache)
        self._hello = Reply(
            Status.OK,
            engine_id=self.config.engine_id,
            agent_metadata=self._agent.get_agent_metadata(),
            base_addr=kv_cache.data_ptr(),
            num_blocks=kv_cache.shape[0],
            block_bytes=block_bytes(kv_cache),
            mem_type=mem_type,
            device_id=device_id,
        )
        self._leases = LeaseTable(kv_cache)
        listener = socket.create_server((self.config.host, self.config.port))
        listener.settimeout(_ACCEPT_POLL_S)
        self._listener = listener
        port = int(listener.getsockname()[1])
        for target, name in ((self._accept_loop, "accept"), (self._progress_loop, "progress")):
            thread = threading.Thread(target=target, name=f"kv-nixl-{name}-{port}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return port

    def stop(self) -> None:
        """Stops serving and joins every thread, well within a second."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=0.5)
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        for _, thread in conns:
            thread.join(timeout=0.5)
        if self._leases is not None:
            self._leases.stop()
        self._verify.shutdown(wait=True, cancel_futures=True)
        self._pool.close()
        with self._lock:
            # A read sees the stop flag at its next poll; one still waiting on a socket sees it
            # before it touches the agent again, so only then is it safe to let go of the memory.
            idle = self._reads_ended.wait_for(lambda: self._num_reading == 0, timeout=0.3)
            peers, self._peers = list(self._peers.values()), {}
        if self._agent is not None and idle:
            for peer in peers:
                self._drop_agent(peer)
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(self._reg)

    # ------------------------------------------------------------------ serving side

    def lease(self, req_id: str, block_ids: list[int], expires_at: float) -> None:
        assert self._leases is not None, "start first"
        self._leases.lease(req_id, block_ids, expires_at)

    def finished_leases(self, now: float) -> tuple[list[str], list[str]]:
        assert self._leases is not None, "start first"
        return self._leases.claimed(), self._leases.expire(now)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        with self._listener:
            while not self._stopping.is_set():
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    break
                _set_io_timeout(conn, self._io_timeout)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                with self._lock:
                    self._conns[conn] = thread
                thread.start()

    def _progress_loop(self) -> None:
        """Polls the agent while a read holds a lease: UCX over TCP needs the target to progress."""
        assert self._leases is not None
        while not self._stopping.is_set():
            if not self._leases.reading.wait(_ACCEPT_POLL_S):
                continue
            if not self._leases.holding():
                continue
            with contextlib.suppress(Exception):
                self._agent.get_new_notifs()
            time.sleep(_PROGRESS_POLL_S)

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                while not self._stopping.is_set():
                    payload = recv_frame(conn)
                    if payload is None:
                        return
                    try:
                        message = message_decoder.decode(payload)
                    except msgspec.DecodeError:
                        send_message(conn, Reply(Status.BAD_REQUEST, self.config.engine_id))
                        return
                    reply = self._handle(message)
                    if reply is not None:
                        send_message(conn, reply)
        except OSError as exc:
            logger.debug("kv side channel ended: %s", exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)

    def _handle(self, message: Message) -> Reply | None:
        assert self._leases is not None and self._hello is not None
        own = self.config.engine_id
        if isinstance(message, Hello):
            return self._hello if message.engine_id == own else Reply(Status.UNKNOWN_ENGINE, own)
        if message.engine_id != own:
            return None if isinstance(message, Done) else Reply(Status.UNKNOWN_ENGINE, own)
        if isinstance(message, Done):
            self._leases.claim(message.request_id)
            return None
        if isinstance(message, Release):
            ok = self._leases.claim(message.request_id)
            return Reply(Status.OK if ok else Status.UNKNOWN_REQUEST, own)
        if message.block_bytes != self._hello.block_bytes:
            return Reply(Status.BLOCK_SIZE_MISMATCH, own, block_bytes=self._hello.block_bytes)
        status, crcs = self._leases.lookup(message.request_id, message.block_ids, message.hold_s)
        return Reply(status, own, crcs=crcs)

    # ------------------------------------------------------------------ reading side

    def read(self, spec: LoadSpec, deadline: float) -> TransferResult:
        start = time.monotonic()
        with self._lock:
            self._num_reading += 1
        try:
            error, num_bytes = self._read(spec, deadline)
        except Exception as exc:  # a bug here must still end the pull as a result
            logger.exception("NIXL read of %s raised", spec.req_id)
            error, num_bytes = f"INTERNAL: {exc}", 0
        finally:
            with self._lock:
                self._num_reading -= 1
                self._reads_ended.notify_all()
        return TransferResult(
            spec.req_id, error is None, error, num_bytes, time.monotonic() - start
        )

    def release_remote(self, remote: RemotePrefill, deadline: float) -> None:
        message = Release(remote.engine_id, remote.request_id)
        reply = self._call(remote.host, remote.port, message, deadline)
        if isinstance(reply, str) or reply.status != Status.OK:
            logger.debug("releasing remote lease %s: %s", remote.request_id, reply)

    def _read(self, spec: LoadSpec, deadline: float) -> tuple[str | None, int]:
        kv, agent = self._kv, self._agent
        assert kv is not None and agent is not None, "start first"
        remote, local_ids, remote_ids = spec.remote, spec.local_block_ids, spec.remote_block_ids
        if len(remote_ids) != len(local_ids) or not local_ids:
            return f"BAD_ARGUMENT: {len(remote_ids)} remote ids vs {len(local_ids)} local ids", 0
        if any(not 0 <= b < kv.shape[0] for b in local_ids):
            return f"BAD_ARGUMENT: local block ids out of range [0, {kv.shape[0]})", 0
        where = f"request {remote.request_id!r} at {remote.host}:{remote.port}"
        peer = self._peer(remote, deadline)
        if isinstance(peer, str):
            return peer, 0
        bpb = block_bytes(kv)
        if peer.block_bytes != bpb:
            return f"BLOCK_SIZE_MISMATCH: server block {peer.block_bytes} B, local {bpb} B", 0
        if any(not 0 <= b < peer.num_blocks for b in remote_ids):
            return f"BAD_BLOCKS: remote ids out of range [0, {peer.num_blocks}) for {where}", 0
        hold = deadline - time.monotonic()
        lookup = Lookup(remote.engine_id, remote.request_id, list(remote_ids), bpb, hold)
        reply = self._call(remote.host, remote.port, lookup, deadline)
        if isinstance(reply, str):
            return reply, 0
        if reply.status != Status.OK:
            if reply.status == Status.UNKNOWN_ENGINE:
                self._forget(remote.host, remote.port)
            return f"{_status_name(reply.status)}: {where}", 0
        if len(reply.crcs) != len(remote_ids):
            return f"PROTOCOL: {len(reply.crcs)} checksums for {len(remote_ids)} blocks", 0

        error, got = self._transfer_and_checksum(peer, remote_ids, local_ids, deadline)
        if error is not None:
            return error, 0
        num_bytes = len(local_ids) * bpb
        bad = [i for i, (a, b) in enumerate(zip(got, reply.crcs, strict=True)) if a != b]
        if bad:
            i = bad[0]
            return (
                f"CHECKSUM_MISMATCH: {len(bad)} of {len(local_ids)} blocks, first remote block "
                f"{remote_ids[i]}: checksum {got[i]:#018x}, server said {reply.crcs[i]:#018x}",
                num_bytes,
            )
        self._notify(remote.host, remote.port, Done(remote.engine_id, remote.request_id), deadline)
        return None, num_bytes

    def _transfer_and_checksum(
        self, peer: _Peer, remote_ids: list[int], local_ids: list[int], deadline: float
    ) -> tuple[str | None, list[int]]:
        """READs chunk by chunk, checksumming each received chunk while the next one is READ;
        (None, the checksum of each local block) or (the error, [])."""
        kv = self._kv
        assert kv is not None
        bpb = block_bytes(kv)
        chunks = split_runs(paired_runs(remote_ids, local_ids), max(1, _CHUNK_BYTES // bpb))
        pending: list[Future[list[int]]] = []
        done = 0
        try:
            for chunk in chunks:
                error = self._transfer(peer, chunk, bpb, deadline)
                if error is not None:
                    return error, []
                count = sum(n for _, _, n in chunk)
                ids = local_ids[done : done + count]
                done += count
                if len(chunks) == 1:
                    return None, block_crcs(kv, ids)
                pending.append(self._verify.submit(block_crcs, kv, ids))
            got: list[int] = []
            for fut in pending:
                got += fut.result(timeout=max(deadline - time.monotonic(), 0.0))
            return None, got
        except TimeoutError:
            return f"DEADLINE: checksumming {len(local_ids)} blocks", []
        finally:
            for fut in pending:
                fut.cancel()

    def _transfer(
        self, peer: _Peer, runs: list[tuple[int, int, int]], bpb: int, deadline: float
    ) -> str | None:
        """One READ of every run, polled until done; None on success, else the error."""
        agent, kv = self._agent, self._kv
        assert kv is not None
        if self._stopping.is_set():
            return "STOPPED: the transport is shutting down"
        local_mem, local_dev = _mem(kv)
        # Nx3 descriptor rows (address, bytes, device id), one per run on either side
        rows = np.array(runs, dtype=np.uint64).reshape(-1, 3)
        sizes = rows[:, 2] * np.uint64(bpb)
        remote_dev = np.full(len(rows), peer.device_id, dtype=np.uint64)
        remote = np.stack([np.uint64(peer.base_addr) + rows[:, 0] * bpb, sizes, remote_dev], 1)
        local_devs = np.full(len(rows), local_dev, dtype=np.uint64)
        local = np.stack([np.uint64(kv.data_ptr()) + rows[:, 1] * bpb, sizes, local_devs], 1)
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, local_mem),
                agent.get_xfer_descs(remote, peer.mem_type),
                peer.agent_name,
            )
        except Exception as exc:  # nixlBackendError and friends: the remote agent is unusable
            self._forget_peer(peer)
            return f"TRANSFER_FAILED: preparing the READ: {exc}"
        state = "ERR"
        try:
            state = agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline and not self._stopping.is_set():
                time.sleep(_READ_POLL_S)
                state = agent.check_xfer_state(handle)
        except Exception as exc:
            return f"TRANSFER_FAILED: {exc}"
        finally:
            try:
                agent.release_xfer_handle(handle)  # cancels a transfer still in progress
            except Exception as exc:
                # NIXL keeps the handle and retries when the agent goes away; until then the
                # transfer may still land in these local blocks, which the caller recomputes.
                logger.error("NIXL could not cancel the READ from %s: %s", peer.agent_name, exc)
        if state == "PROC" and self._stopping.is_set():
            return "STOPPED: the transport is shutting down"
        if state == "PROC":
            return f"DEADLINE: NIXL READ from {peer.agent_name} not done"
        if state != "DONE":
            return f"TRANSFER_FAILED: NIXL READ from {peer.agent_name} ended in state {state}"
        return None

    def _peer(self, remote: RemotePrefill, deadline: float) -> _Peer | str:
        """The remote engine's agent, added at first contact; an error string otherwise."""
        key = (remote.host, remote.port)
        with self._lock:
            peer = self._peers.get(key)
        if peer is not None and peer.engine_id == remote.engine_id:
            return peer
        reply = self._call(remote.host, remote.port, Hello(remote.engine_id), deadline)
        if isinstance(reply, str):
            return reply
        if peer is not None and peer.engine_id != reply.engine_id:
            self._forget(*key)  # that engine restarted: its agent and memory are gone
        if reply.status != Status.OK:
            return f"{_status_name(reply.status)}: {remote.host}:{remote.port} is engine " + (
                f"{reply.engine_id!r}, not {remote.engine_id!r}"
            )
        try:
            name = self._agent.add_remote_agent(reply.agent_metadata)
        except Exception as exc:
            return (
                f"CONNECT_FAILED: loading the NIXL metadata of {remote.host}:{remote.port}: {exc}"
            )
        name = name.decode() if isinstance(name, bytes) else str(name)
        peer = _Peer(
            reply.engine_id,
            name,
            reply.base_addr,
            reply.num_blocks,
            reply.block_bytes,
            reply.mem_type,
            reply.device_id,
        )
        with self._lock:
            self._peers[key] = peer
        return peer

    def _forget(self, host: str, port: int) -> None:
        with self._lock:
            peer = self._peers.pop((host, port), None)
        if peer is not None:
            self._drop_agent(peer)

    def _forget_peer(self, peer: _Peer) -> None:
        with self._lock:
            key = next((k for k, p in self._peers.items() if p is peer), None)
            if key is None:
                return
            del self._peers[key]
        self._drop_agent(peer)

    def _drop_agent(self, peer: _Peer) -> None:
        try:
            self._agent.remove_remote_agent(peer.agent_name)
        except Exception as exc:
            logger.debug("removing NIXL agent %s: %s", peer.agent_name, exc)

    # ------------------------------------------------------------------ side-channel client

    def _connect(self, host: str, port: int, deadline: float) -> socket.socket | str:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"DEADLINE: connecting to {host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=left)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except TimeoutError:
            return f"DEADLINE: connecting to {host}:{port}"
        except OSError as exc:
            return f"CONNECT_FAILED: {host}:{port}: {exc}"
        return sock

    def _call(self, host: str, port: int, message: Message, deadline: float) -> Reply | str:
        """One request and its reply, over a pooled connection when there is one (retried once on
        a new connection when the pooled one turns out dead before any reply byte)."""
        for pooled in (True, False):
            sock = self._pool.take(host, port) if pooled else self._connect(host, port, deadline)
            if sock is None:
                continue
            if isinstance(sock, str):
                return sock
            replied = False
            try:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("deadline passed")
                _set_io_timeout(sock, left)
                send_message(sock, message)
                payload = recv_frame(sock)
                replied = payload is not None
                if payload is None:
                    raise ConnectionError("connection closed before the reply")
                reply = reply_decoder.decode(payload)
            except msgspec.DecodeError as exc:
                sock.close()
                return f"PROTOCOL: bad reply from {host}:{port}: {exc}"
            except OSError as exc:
                sock.close()
                if pooled and not replied and not _is_deadline(exc):
                    continue
                if _is_deadline(exc):
                    return f"DEADLINE: waiting for {host}:{port}"
                return f"SHORT_READ: side channel to {host}:{port}: {exc}"
            self._pool.give(host, port, sock)
            return reply
        return f"CONNECT_FAILED: {host}:{port}"  # unreachable: the second pass always returns

    def _notify(self, host: str, port: int, message: Done, deadline: float) -> None:
        """Sends a one-way message; a lost Done leaves the lease to expire, as with TCP."""
        sock = self._pool.take(host, port) or self._connect(host, port, deadline)
        if isinstance(sock, str):
            logger.debug("sending %s: %s", message, sock)
            return
        try:
            _set_io_timeout(sock, max(deadline - time.monotonic(), 0.5))
            send_message(sock, message)
        except OSError as exc:
            logger.debug("sending %s: %s", message, exc)
            sock.close()
            return
        self._pool.give(host, port, sock)


def _is_deadline(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and _is_timeout(exc)


def _status_name(status: int) -> str:
    try:
        return Status(status).name
    except ValueError:
        return f"STATUS_{status}"
