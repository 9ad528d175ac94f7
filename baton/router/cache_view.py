"""How much of a prompt each engine already holds: exactly, from the engine's KV events, where
it publishes them and the router has the prompt's token ids; else as the approximate index
guesses from what the router sent where."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

from baton.router.kv_index import KVIndex, Pending
from baton.router.kv_subscriber import Subscriptions
from baton.router.prefix_index import PrefixIndex
from baton.router.prompts import Prompt

Mode = Literal["exact", "approximate"]
PENDING_SECONDS = 5.0  # how long a block sent to compute counts as held before events say so


class CacheView:
    def __init__(
        self, approximate: PrefixIndex, exact: KVIndex, subs: Subscriptions, block_chars: int
    ) -> None:
        self.approximate = approximate
        self.exact = exact
        self.subs = subs
        self.block_chars = block_chars
        self.pending = Pending(PENDING_SECONDS)

    def mode(self, engine: str) -> Mode:
        return "exact" if self.subs.block_size(engine) is not None else "approximate"

    def fractions(self, engines: Sequence[str], prompt: Prompt) -> dict[str, float]:
        """For each engine, the fraction of the prompt it holds: exact tokens where it can be
        told, else approximate blocks."""
        held = self._exact_fractions(engines, prompt)
        guessed = [e for e in engines if e not in held]
        return {**self.sent_fractions(guessed, prompt), **held} if guessed else held

    def placement(self, engines: Sequence[str], prompt: Prompt) -> dict[str, float]:
        """What the prefix-aware policy weighs against load: for each engine, the larger of the
        fraction it holds and the fraction this router sent it before (the prompt's home).

        The held fraction alone (exact, from events) moves a family whose blocks an engine
        evicted to whichever engine is least loaded, evicting another family there, and so on
        round the pool; measured on `bench/prefix_routing.py`, that costs hit rate (0.80 against
        0.875 for the router's own record). Its home keeps it put. What the events add is what
        this router did not send: another replica's placements, restarts, blocks a client
        computed directly, and exact numbers for the hand-off's decisions (`cached_tokens`)."""
        home = self.sent_fractions(engines, prompt)
        held = self._exact_fractions(engines, prompt)
        for engine, fraction in held.items():
            if fraction > home[engine]:
                home[engine] = fraction
        return home

    def _exact_fractions(self, engines: Sequence[str], prompt: Prompt) -> dict[str, float]:
        """The fraction each engine holds, for the engines it can be told of exactly."""
        out: dict[str, float] = {}
        if prompt.tokens is None:
            return out
        for engine in engines:
            block_size = self.subs.block_size(engine)
            if block_size is not None:
                held = self._held_blocks(engine, prompt.exact_hashes(block_size))
                out[engine] = held * block_size / max(1, len(prompt.tokens))
        return out

    def sent_fractions(self, engines: Sequence[str], prompt: Prompt) -> dict[str, float]:
        """For each engine, the fraction of the prompt the router has sent it before (the
        approximate index): a guess of what it holds, and where the prompt's family lives."""
        hashes = prompt.block_hashes(self.block_chars)
        fractions = dict.fromkeys(engines, 0.0)
        if hashes:
            for engine, blocks in self.approximate.match(hashes, engines).items():
                if blocks:
                    fractions[engine] = blocks / len(hashes)
        return fractions

    def cached_tokens(self, engine: str, prompt: Prompt) -> int | None:
        """The prompt's tokens `engine` holds, when known exactly."""
        block_size = self.subs.block_size(engine)
        if block_size is None or prompt.tokens is None:
            return None
        return self._held_blocks(engine, prompt.exact_hashes(block_size)) * block_size

    def _held_blocks(self, engine: str, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` the engine holds, or is computing for a request the
        router sent it moments ago."""
        if not hashes:
            return 0
        self.pending.expire(time.monotonic())
        held = self.exact.match(hashes, (engine,))[engine]
        return max(held, self.pending.match(hashes, (engine,))[engine])

    def blocks_sent(self, engine: str) -> int:
        """How much the router has sent `engine` lately (the approximate index's size): new
        prompt families go where it is least, so that they spread over the caches. (An
        engine's cached set says less: once warm, every pool is full.)"""
        return self.approximate.num_blocks(engine)

    def record(self, engine: str, prompt: Prompt) -> None:
        """`engine` is about to compute `prompt`: its exact blocks count as held for a moment
        (until its events can say so), and the approximate index remembers it (the fallback
        for requests the router cannot tokenize)."""
        block_size = self.subs.block_size(engine)
        if block_size is not None and prompt.tokens is not None:
            self.pending.record(engine, prompt.exact_hashes(block_size), time.monotonic())
        hashes = prompt.block_hashes(self.block_chars)
        if hashes:
            self.approximate.record(engine, hashes)

    def forget(self, engine: str) -> None:
        self.approximate.forget(engine)
        self.pending.forget(engine)
