"""The `KVTransport` over NIXL (see the package docstring): the agent and its registered KV
tensor, the serving side's leases, and the reading side's READs of other engines' blocks.
Importing it raises ImportError when no NIXL package imports."""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from baton.kv_transfer.base import KVTransferConfig, LoadSpec, TransferResult
from baton.kv_transfer.checksum import KINDS, block_bytes, block_crcs, kind_for
from baton.kv_transfer.keyring import KeyRing
from baton.kv_transfer.leases import LeaseTable, Status, status_name
from baton.kv_transfer.nixl.channel import (
    Channel,
    Done,
    Hello,
    Lookup,
    Release,
    Reply,
    call,
    notify,
    paired_runs,
    split_runs,
)
from baton.kv_transfer.nixl.server import SideChannelServer
from baton.kv_transfer.params import RemotePrefill
from baton.kv_transfer.sockets import KVConnectionPool

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

_READ_POLL_S = 0.00002  # reader's pause between transfer-state polls, to let other threads run
# Bytes per READ: the reader checksums one chunk on its verify thread while NIXL copies the next
# (it releases the GIL during the copy). On an idle two-core machine 4-16 MiB chunks READ and
# checked 256 MiB at 1.8x the rate of one READ followed by the checksum pass; on a busy one they
# tie. Reads of one chunk or less are checked inline, without the thread hop.
_CHUNK_BYTES = 16 << 20


def _mem(kv_cache: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of the tensor."""
    if kv_cache.device.type == "cuda":
        return "VRAM", kv_cache.get_device()
    return "DRAM", 0


@dataclass(frozen=True)
class _Peer:
    """A remote engine as the reader knows it: its answer to Hello, and its agent added here."""

    hello: Reply
    agent_name: str


class NixlTransport:
    """The `KVTransport` over NIXL; see the package docstring."""

    name = "nixl"

    def __init__(self, config: KVTransferConfig, keys: KeyRing) -> None:
        self.config = config
        self.keys = keys
        self._agent: Any = None
        self._reg: Any = None
        self._kv: torch.Tensor | None = None
        self._leases: LeaseTable | None = None
        self._hello: Reply | None = None
        self._server: SideChannelServer | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._reads_ended = threading.Condition(self._lock)
        self._num_reading = 0  # reads in progress; stop() lets them end before deregistering
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._pool = KVConnectionPool()  # side-channel connections
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
        # Shared memory needs UCX's error handling off; UCX_TLS and UCX_NET_DEVICES are left to
        # the deployment.
        self._agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        self._reg = self._agent.register_memory(kv_cache)
        self._kv = kv_cache
        # Checksummed where the blocks live, so that a read from device memory stays zero-copy.
        self._leases = LeaseTable(kv_cache, self.config.engine_id, kind_for(kv_cache))
        mem_type, device_id = _mem(kv_cache)
        self._hello = Reply(
            Status.OK,
            engine_id=self.config.engine_id,
            agent_metadata=self._agent.get_agent_metadata(),
            base_addr=kv_cache.data_ptr(),
            num_blocks=kv_cache.shape[0],
            block_bytes=self._leases.block_bytes,
            mem_type=mem_type,
            device_id=device_id,
            checksum=self._leases.checksum,
        )
        self._server = SideChannelServer(
            self.config.host, self.config.port, self._leases, self._hello, self._agent, self.keys
        )
        return self._server.start()

    def stop(self) -> None:
        """Stops serving and joins every thread, well within a second."""
        self._stopping.set()
        if self._server is not None:
            self._server.stop()
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

    def lease(
        self,
        req_id: str,
        block_ids: list[int],
        expires_at: float,
        client_request_id: str | None = None,
    ) -> None:
        assert self._leases is not None, "start first"
        self._leases.lease(req_id, block_ids, expires_at, client_request_id)

    def finished_leases(self, now: float) -> tuple[list[str], list[str]]:
        assert self._leases is not None, "start first"
        return self._leases.claimed(), self._leases.expire(now)

    # ------------------------------------------------------------------ reading side

    def read(self, spec: LoadSpec, deadline: float) -> TransferResult:
        start = time.monotonic()
        with self._lock:
            self._num_reading += 1
        try:  # a bug that raises here still ends the pull: the connector reports it INTERNAL
            error, num_bytes = self._read(spec, deadline)
        finally:
            with self._lock:
                self._num_reading -= 1
                self._reads_ended.notify_all()
        return TransferResult(
            spec.req_id, error is None, error, num_bytes, time.monotonic() - start
        )

    def release_remote(self, remote: RemotePrefill, deadline: float) -> None:
        message = Release(remote.engine_id, remote.request_id)
        reply = call(self._channel(remote), message, deadline)
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
        if peer.hello.block_bytes != bpb:
            return f"BLOCK_SIZE_MISMATCH: server block {peer.hello.block_bytes} B, local {bpb} B", 0
        num_remote = peer.hello.num_blocks
        if any(not 0 <= b < num_remote for b in remote_ids):
            return f"BAD_BLOCKS: remote ids out of range [0, {num_remote}) for {where}", 0
        hold = deadline - time.monotonic()
        lookup = Lookup(remote.engine_id, remote.request_id, list(remote_ids), bpb, hold)
        reply = call(self._channel(remote), lookup, deadline)
        if isinstance(reply, str):
            return reply, 0
        if reply.status != Status.OK:
            if reply.status == Status.UNKNOWN_ENGINE:
                self._forget(peer)
            return f"{status_name(reply.status)}: {where}", 0
        if len(reply.crcs) != len(remote_ids):
            return f"PROTOCOL: {len(reply.crcs)} checksums for {len(remote_ids)} blocks", 0
        if peer.hello.checksum not in KINDS:
            return f"PROTOCOL: unknown block checksum {peer.hello.checksum!r} from {where}", 0

        # The server's kind, computed here wherever this side's blocks are (sum64 on a CPU reader
        # of a GPU server is slow but correct; xxh3 on a GPU reader copies to the host).
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
        done = Done(remote.engine_id, remote.request_id)
        notify(self._channel(remote), done, deadline)
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
                    return None, block_crcs(kv, ids, peer.hello.checksum)
                pending.append(self._verify.submit(block_crcs, kv, ids, peer.hello.checksum))
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
        remote_dev = np.full(len(rows), peer.hello.device_id, dtype=np.uint64)
        remote = np.stack(
            [np.uint64(peer.hello.base_addr) + rows[:, 0] * bpb, sizes, remote_dev], 1
        )
        local_devs = np.full(len(rows), local_dev, dtype=np.uint64)
        local = np.stack([np.uint64(kv.data_ptr()) + rows[:, 1] * bpb, sizes, local_devs], 1)
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, local_mem),
                agent.get_xfer_descs(remote, peer.hello.mem_type),
                peer.agent_name,
            )
        except Exception as exc:  # nixlBackendError and friends: the remote agent is unusable
            self._forget(peer)
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
        if peer is not None and peer.hello.engine_id == remote.engine_id:
            return peer
        reply = call(self._channel(remote), Hello(remote.engine_id), deadline)
        if isinstance(reply, str):
            return reply
        # An engine id only an answer from the engine carries (a refusal to a peer without the
        # key carries none, and must not cost other readers the cached agent).
        if peer is not None and reply.engine_id and peer.hello.engine_id != reply.engine_id:
            self._forget(peer)  # that engine restarted: its agent and memory are gone
        if reply.status == Status.UNAUTHORIZED:
            return f"UNAUTHORIZED: {remote.host}:{remote.port} refused key {remote.key_id!r}"
        if reply.status != Status.OK:
            return f"{status_name(reply.status)}: {remote.host}:{remote.port} is engine " + (
                f"{reply.engine_id!r}, not {remote.engine_id!r}"
            )
        try:
            name = self._agent.add_remote_agent(reply.agent_metadata)
        except Exception as exc:
            return (
                f"CONNECT_FAILED: loading the NIXL metadata of {remote.host}:{remote.port}: {exc}"
            )
        peer = _Peer(reply, name.decode() if isinstance(name, bytes) else str(name))
        with self._lock:
            self._peers[key] = peer
        return peer

    def _channel(self, remote: RemotePrefill) -> Channel:
        return Channel(self._pool, remote.host, remote.port, self.keys, remote.key_id)

    def _forget(self, peer: _Peer) -> None:
        """Drops ``peer``'s agent, unless another thread already replaced or dropped it."""
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
