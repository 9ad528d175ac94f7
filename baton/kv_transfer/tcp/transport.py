"""The TCP transport behind the KV connector: a `KVBlockServer` for this engine's leases and
pooled `read_blocks` pulls from other engines' servers. A KV cache outside host memory (or any,
with ``staging = "always"``) moves through host staging buffers (``staging.py``)."""

from __future__ import annotations

import logging

import torch

from baton.kv_transfer.base import KVTransferConfig, LoadSpec, TransferResult
from baton.kv_transfer.keyring import KeyRing
from baton.kv_transfer.params import RemotePrefill
from baton.kv_transfer.sockets import KVConnectionPool
from baton.kv_transfer.tcp.reader import Lease, read_blocks, release_lease
from baton.kv_transfer.tcp.server import KVBlockServer
from baton.kv_transfer.tcp.staging import StagingPool, uses_staging

logger = logging.getLogger(__name__)


class TCPTransport:
    """The `KVTransport` over TCP, from and to host or device memory."""

    name = "tcp"

    def __init__(self, config: KVTransferConfig, keys: KeyRing) -> None:
        self.config = config
        self.keys = keys
        self._server: KVBlockServer | None = None
        self._kv_cache: torch.Tensor | None = None
        self._staging: StagingPool | None = None  # for both the server and the reader
        self._pool = KVConnectionPool()

    def start(self, kv_cache: torch.Tensor) -> int:
        stage = uses_staging(kv_cache, self.config.staging)
        logger.info(
            "TCP KV transport: KV cache on %s, %s",
            kv_cache.device,
            "staged through host buffers" if stage else "sent from and received into place",
        )
        self._kv_cache = kv_cache
        self._staging = StagingPool(kv_cache) if stage else None
        self._server = KVBlockServer(
            kv_cache,
            self.config.engine_id,
            self.keys,
            self.config.host,
            self.config.port,
            staging=self._staging,
        )
        return self._server.start()

    def lease(
        self,
        req_id: str,
        block_ids: list[int],
        expires_at: float,
        client_request_id: str | None = None,
    ) -> None:
        assert self._server is not None, "start first"
        self._server.leases.lease(req_id, block_ids, expires_at, client_request_id)

    def finished_leases(self, now: float) -> tuple[list[str], list[str]]:
        assert self._server is not None, "start first"
        return self._server.leases.claimed(), self._server.leases.expire(now)

    def read(self, spec: LoadSpec, deadline: float) -> TransferResult:
        assert self._kv_cache is not None, "start first"
        return read_blocks(
            self._lease(spec.remote),
            spec.remote_block_ids,
            self._kv_cache,
            spec.local_block_ids,
            deadline,
            pool=self._pool,
            req_id=spec.req_id,
            staging=self._staging,
        )

    def release_remote(self, remote: RemotePrefill, deadline: float) -> None:
        error = release_lease(self._lease(remote), deadline, pool=self._pool)
        if error is not None:
            logger.debug("releasing remote lease %s: %s", remote.request_id, error)

    def _lease(self, r: RemotePrefill) -> Lease:
        return Lease(r.host, r.port, r.engine_id, r.request_id, self.keys, r.key_id)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        self._pool.close()
        if self._staging is not None:
            self._staging.close()
