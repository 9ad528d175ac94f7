"""Which engine holds which prompt blocks, for prefix-aware routing: `BlockOwners` (hash ->
engines, and matching a prompt's chain against them), and `PrefixIndex`, the approximate index
for engines that publish no KV events.

The approximate index cannot see the engines' caches; it remembers what the router sent where.
Each engine gets an LRU of block hashes bounded by `capacity` (engines evict too, so the index
forgets the oldest). Each hash maps to the engines holding it, so matching a prompt against all
engines walks the prompt's blocks once, not once per engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence


class BlockOwners:
    """Block hash -> the engines holding it, and each engine's hashes."""

    def __init__(self) -> None:
        self._owners: dict[int, set[str]] = {}
        self._held: dict[str, Collection[int]] = {}

    def match(self, hashes: Sequence[int], engines: Iterable[str]) -> dict[str, int]:
        """For each engine, how many of the leading `hashes` it holds (the prefix it caches)."""
        alive = set(engines)
        matched = dict.fromkeys(alive, 0)
        for i, h in enumerate(hashes):
            owners = self._owners.get(h)
            if owners is None:
                return matched
            alive &= owners
            if not alive:
                return matched
            for engine in alive:
                matched[engine] = i + 1
        return matched

    def num_blocks(self, engine: str) -> int:
        return len(self._held.get(engine, ()))

    def forget(self, engine: str) -> None:
        """`engine` lost its cache (restarted, removed): drop everything it held."""
        for h in self._held.pop(engine, ()):
            self._drop_owner(h, engine)

    def _add_owner(self, h: int, engine: str) -> None:
        self._owners.setdefault(h, set()).add(engine)

    def _drop_owner(self, h: int, engine: str) -> None:
        owners = self._owners.get(h)
        if owners is not None:
            owners.discard(engine)
            if not owners:
                del self._owners[h]


class PrefixIndex(BlockOwners):
    """The approximate index: an LRU of the hashes of what the router sent to each engine."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def record(self, engine: str, hashes: Sequence[int]) -> None:
        """`engine` now holds the blocks `hashes` (a prompt's chain, first block first)."""
        lru = self._lru.get(engine)
        if lru is None:
            lru = self._lru[engine] = OrderedDict()
            self._held[engine] = lru
        # Newest last, and the first block newest of all: as in the engines, a prompt's tail
        # is evicted before its head, so the index keeps a usable prefix while it shrinks.
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._add_owner(h, engine)
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            self._drop_owner(old, engine)

    def forget(self, engine: str) -> None:
        super().forget(engine)
        self._lru.pop(engine, None)
