"""How the router picks one engine among the candidates of a role: round-robin, least-load,
prefix-aware, and session affinity on top of any of them.

A policy is given only available candidates (never an empty list) and returns one of them; it
does no I/O. Ties go to the least recently taken candidate, so equal engines share the work.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from typing import Protocol

from baton.router.cache_view import CacheView
from baton.router.config import PolicyName
from baton.router.engines import EngineState
from baton.router.prompts import Prompt

# prefix-aware: extra load that cancels a full prefix match is `prefix_load_weight` times
# (the least loaded candidate's load + LOAD_SLACK), so an idle cluster tolerates 8 extra
# requests on the engine holding a prompt's prefix, and a busy one proportionally more.
LOAD_SLACK = 8.0


class Policy(Protocol):
    def choose(self, candidates: Sequence[EngineState], prompt: Prompt) -> EngineState:
        """One of `candidates` (non-empty) for a request with `prompt`."""
        ...


class RoundRobin:
    """Each candidate in turn; the other policies take turns like this among their ties.

    The turn is the least recently taken candidate, not a counter modulo the candidates: the
    candidates differ from one request to the next (only the engines that can pair with the
    chosen decode engine, say), and a shared counter over varying lists can land on the same
    engine of a list every time it is offered.
    """

    def __init__(self) -> None:
        self._picks = 0
        # engine -> the pick number it was last taken at; weak, so engines that leave go too
        self._taken: weakref.WeakKeyDictionary[EngineState, int] = weakref.WeakKeyDictionary()

    def choose(self, candidates: Sequence[EngineState], prompt: Prompt) -> EngineState:
        return self._take(candidates)

    def _take(self, candidates: Sequence[EngineState]) -> EngineState:
        choice = min(candidates, key=lambda s: self._taken.get(s, -1))
        self._picks += 1
        self._taken[choice] = self._picks
        return choice


class LeastLoad(RoundRobin):
    """The candidate with the fewest running + waiting requests (scraped, corrected by the
    router's own in-flight counts since the scrape)."""

    def choose(self, candidates: Sequence[EngineState], prompt: Prompt) -> EngineState:
        least = min(s.load() for s in candidates)
        return self._take([s for s in candidates if s.load() == least])


class PrefixAware(RoundRobin):
    """The candidate holding most of the prompt, scored against load.

    score = cached fraction of the prompt - weight * (load - least load) / (least load + 8),
    where the cached fraction is exact (matched tokens / prompt tokens, from the engine's KV
    events, or the fraction this router sent it if larger) or approximate (matched blocks /
    prompt blocks, from the router's own record); see `CacheView.placement`. With no match
    anywhere this is least-load, ties going to the engine the router has sent the least; with a
    match, the holder keeps the prompt's family until it is clearly busier than the others.
    """

    def __init__(self, view: CacheView, load_weight: float) -> None:
        super().__init__()
        self.view = view
        self.load_weight = load_weight

    def scores(self, candidates: Sequence[EngineState], prompt: Prompt) -> list[float]:
        cached = self.view.placement([s.url for s in candidates], prompt)
        loads = [s.load() for s in candidates]
        least = min(loads)
        scale = least + LOAD_SLACK
        return [
            cached[s.url] - self.load_weight * (load - least) / scale
            for s, load in zip(candidates, loads, strict=True)
        ]

    def choose(self, candidates: Sequence[EngineState], prompt: Prompt) -> EngineState:
        scores = self.scores(candidates, prompt)
        best = max(scores)
        top = [s for s, x in zip(candidates, scores, strict=True) if x == best]
        if len(top) > 1:
            # A prompt no engine holds: its family stays where the router sent it before (an
            # engine that evicted it computes it again, rather than evicting another family
            # elsewhere); a new family goes where the router has sent the least, so families
            # spread over the caches instead of piling on one by chance.
            sent = self.view.sent_fractions([s.url for s in top], prompt)
            most = max(sent.values())
            top = [s for s in top if sent[s.url] == most]
            least = min(self.view.blocks_sent(s.url) for s in top)
            top = [s for s in top if self.view.blocks_sent(s.url) == least]
        return self._take(top)


def session_choice(candidates: Sequence[EngineState], session_id: str) -> EngineState:
    """The candidate a session sticks to: rendezvous hashing on (session, engine URL), so the
    choice is the same in every router replica and moves only when that engine goes away."""

    def weight(state: EngineState) -> bytes:
        key = f"{session_id}\0{state.url}".encode()
        return hashlib.blake2b(key, digest_size=8).digest()

    return max(candidates, key=weight)


def make_policy(name: PolicyName, view: CacheView, weight: float) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "prefix-aware":
        return PrefixAware(view, weight)
    raise ValueError(f"unknown policy {name!r}")
