"""Choosing an engine: round-robin, least-load with in-flight correction, prefix-aware against
load, and session affinity."""

from __future__ import annotations

from collections import Counter

from baton.block_hash import block_hashes, external_hash
from baton.kv_events import BlockRemoved, BlockStored
from baton.router.cache_view import CacheView
from baton.router.discovery import Endpoint
from baton.router.engines import EngineState
from baton.router.kv_index import KVIndex
from baton.router.kv_subscriber import Subscriptions
from baton.router.policies import LeastLoad, PrefixAware, RoundRobin, session_choice
from baton.router.prefix_index import PrefixIndex
from baton.router.prompts import Prompt, prompt_of


def _view(index: PrefixIndex, exact: KVIndex | None = None) -> CacheView:
    exact = exact or KVIndex()
    return CacheView(index, exact, Subscriptions(exact), block_chars=64)


def _engines(n: int) -> list[EngineState]:
    return [EngineState(Endpoint(f"http://e{i}:8000", "both", "m")) for i in range(n)]


def test_round_robin_takes_turns() -> None:
    """Each engine in turn."""
    engines, policy = _engines(3), RoundRobin()
    picks = [policy.choose(engines, Prompt()).url for _ in range(6)]
    assert picks == [e.url for e in engines] * 2


def test_round_robin_takes_turns_when_the_candidates_vary() -> None:
    """Candidates that change between requests (the engines that can pair with each chosen
    decode engine) still take turns: alternating [a, b] and [c] does not starve b."""
    a, b, c = _engines(3)
    policy = RoundRobin()
    picks = [policy.choose([a, b] if i % 2 == 0 else [c], Prompt()) for i in range(8)]
    assert Counter(p.url for p in picks[::2]) == {a.url: 2, b.url: 2}


def test_least_load_corrects_scrapes_by_in_flight_counts() -> None:
    """The scraped load is corrected by requests sent and finished since the scrape."""
    a, b = _engines(2)
    a.scraped_load, b.scraped_load = 5, 0
    assert LeastLoad().choose([a, b], Prompt()) is b
    b.in_flight = 10  # sent since the scrape (which saw 0 in flight)
    assert b.load() == 10 and LeastLoad().choose([a, b], Prompt()) is a
    a.in_flight_at_scrape = 5  # a's 5 were the router's own, and they have finished
    assert a.load() == 0


def test_least_load_shares_ties() -> None:
    """Equally loaded engines share the work."""
    engines, policy = _engines(2), LeastLoad()
    assert Counter(policy.choose(engines, Prompt()).url for _ in range(4)) == {
        "http://e0:8000": 2,
        "http://e1:8000": 2,
    }


def test_prefix_aware_keeps_families_together_and_spreads_new_ones() -> None:
    """Prompts sharing a system prompt go where it was sent; new system prompts spread."""
    engines = _engines(4)
    index = PrefixIndex(1000)
    policy = PrefixAware(_view(index), load_weight=1.0)
    placed: dict[int, str] = {}
    for user in range(3):
        for family in range(8):
            prompt = prompt_of({"prompt": f"system {family} " * 30 + f"user {user}"})
            choice = policy.choose(engines, prompt)
            index.record(choice.url, prompt.block_hashes(64))
            assert placed.setdefault(family, choice.url) == choice.url
    assert Counter(placed.values()) == {e.url: 2 for e in engines}


def test_prefix_aware_gives_way_to_load() -> None:
    """The engine holding a prefix loses it to an idle engine once clearly overloaded."""
    a, b = _engines(2)
    index = PrefixIndex(1000)
    policy = PrefixAware(_view(index), load_weight=1.0)
    prompt = prompt_of({"prompt": "shared " * 40})
    index.record(a.url, prompt.block_hashes(64))
    a.scraped_load = 4
    assert policy.choose([a, b], prompt) is a
    a.scraped_load = 12  # 12 more than b over a slack of 8: worse than a full match is worth
    assert policy.choose([a, b], prompt) is b


def test_prefix_aware_scores_exact_tokens_from_events() -> None:
    """An engine whose KV events say it holds the prompt's first blocks wins on matched tokens,
    counted with the request's salt: the same tokens under another salt match nothing, and an
    eviction takes the match away."""
    a, b, c = _engines(3)
    exact = KVIndex()
    view = _view(PrefixIndex(1000), exact)
    view.subs.block_size = lambda url: 4  # type: ignore[method-assign]  # both followed
    policy = PrefixAware(view, load_weight=1.0)
    tokens = list(range(100, 140))  # 10 blocks of 4
    ints = [external_hash(h) for h in block_hashes(tokens, 4)]
    exact.apply(a.url, [BlockStored(ints[:3], None, tokens[:12], 4)])
    exact.apply(b.url, [BlockStored(ints[:8], None, tokens[:32], 4)])
    prompt = Prompt(text="x", tokens=tokens)
    assert view.fractions([a.url, b.url, c.url], prompt) == {a.url: 0.3, b.url: 0.8, c.url: 0.0}
    assert policy.choose([a, b, c], prompt) is b
    salted = Prompt(text="x", tokens=tokens, cache_salt="tenant-2")
    assert view.fractions([a.url, b.url], salted) == {a.url: 0.0, b.url: 0.0}
    exact.apply(b.url, [BlockRemoved(ints[1:2])])  # a hole after block 0: 1 block usable
    assert view.cached_tokens(b.url, prompt) == 4
    assert policy.choose([a, b, c], prompt) is a


def test_session_affinity_is_stable_and_moves_only_when_its_engine_goes() -> None:
    """A session sticks to one engine; removing another engine leaves it in place."""
    engines = _engines(4)
    homes = {s: session_choice(engines, f"session-{s}") for s in range(40)}
    assert len(set(homes.values())) == 4
    assert all(session_choice(engines, f"session-{s}") is homes[s] for s in range(40))
    gone = engines[0]
    rest = engines[1:]
    for s, home in homes.items():
        if home is not gone:
            assert session_choice(rest, f"session-{s}") is home
