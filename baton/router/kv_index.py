"""The exact index: which engine holds which block, as the engines' KV events say.

Each engine's events are applied in their order (`kv_subscriber` sees to gaps and restarts),
so an engine's entry is its block pool's cached set, keyed by the events' block hashes. Memory
is bounded by the engines' own pools; `max_blocks` guards against an engine whose removals
were lost: past it, the engine's entries are dropped and rebuilt from its next events.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable, Sequence

from baton.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from baton.router.prefix_index import BlockOwners

logger = logging.getLogger(__name__)


class KVIndex(BlockOwners):
    """Block hash -> engines holding it, from KV events."""

    def __init__(self, max_blocks: int = 1 << 22) -> None:
        super().__init__()
        self.max_blocks = max_blocks

    def apply(self, engine: str, events: Iterable[KVCacheEvent]) -> None:
        """Applies one batch of `engine`'s events."""
        held = self._held.setdefault(engine, set())
        assert isinstance(held, set)
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    if h not in held:
                        held.add(h)
                        self._add_owner(h, engine)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    if h in held:
                        held.discard(h)
                        self._drop_owner(h, engine)
            elif isinstance(event, AllBlocksCleared):
                self.forget(engine)
                held = self._held.setdefault(engine, set())
                assert isinstance(held, set)
        if len(held) > self.max_blocks:
            logger.warning(
                "engine %s: %d indexed blocks exceed %d; dropping them", engine, len(held),
                self.max_blocks,
            )  # fmt: skip
            self.forget(engine)

    def hashes(self, engine: str) -> set[int]:
        """The block hashes `engine` holds (a copy)."""
        return set(self._held.get(engine, ()))


class Pending(BlockOwners):
    """Blocks the router has just sent an engine to compute, before its events can say so: each
    counts as held for `ttl` seconds. Without it, requests of a new prompt family that arrive
    together would spread over the engines while the first one's blocks are being computed."""

    def __init__(self, ttl: float) -> None:
        super().__init__()
        self.ttl = ttl
        self._sent: deque[tuple[float, str, Sequence[int]]] = deque()  # (expiry, engine, hashes)

    def record(self, engine: str, hashes: Sequence[int], now: float) -> None:
        self.expire(now)
        held = self._held.setdefault(engine, Counter())
        assert isinstance(held, Counter)
        for h in hashes:
            if not held[h]:
                self._add_owner(h, engine)
            held[h] += 1
        self._sent.append((now + self.ttl, engine, hashes))

    def expire(self, now: float) -> None:
        while self._sent and self._sent[0][0] <= now:
            _, engine, hashes = self._sent.popleft()
            held = self._held.get(engine)
            if not isinstance(held, Counter):
                continue  # forgotten meanwhile
            for h in hashes:
                if h not in held:
                    continue
                held[h] -= 1
                if held[h] <= 0:
                    del held[h]
                    self._drop_owner(h, engine)
