"""The approximate prefix index: matching, LRU forgetting, and engines that lose their cache."""

from __future__ import annotations

import pytest

from baton.router.prefix_index import PrefixIndex


def test_match_counts_each_engines_leading_blocks() -> None:
    """Each engine's match is the length of the prompt's prefix it holds, not any overlap."""
    index = PrefixIndex(capacity=100)
    index.record("a", [1, 2, 3, 4])
    index.record("b", [1, 2, 9])
    index.record("c", [2, 3, 4])  # no first block: no prefix
    assert index.match([1, 2, 3, 4, 5], ["a", "b", "c", "d"]) == {"a": 4, "b": 2, "c": 0, "d": 0}


def test_capacity_evicts_tails_before_heads() -> None:
    """Past its capacity an engine forgets old prompts first, and a prompt's tail before its
    head, so what is left still matches as a prefix."""
    index = PrefixIndex(capacity=4)
    index.record("a", [1, 2, 3])
    index.record("a", [7, 8])
    assert index.num_blocks("a") == 4
    assert index.match([1, 2, 3], ["a"]) == {"a": 2}  # block 3 went first
    assert index.match([7, 8], ["a"]) == {"a": 2}


def test_forget_drops_an_engine_everywhere() -> None:
    """An engine that lost its cache matches nothing; others keep their entries."""
    index = PrefixIndex(capacity=10)
    index.record("a", [1, 2])
    index.record("b", [1, 2])
    index.forget("a")
    assert index.match([1, 2], ["a", "b"]) == {"a": 0, "b": 2} and index.num_blocks("a") == 0


def test_capacity_must_be_positive() -> None:
    """A zero capacity is a configuration error, not an index that forgets everything."""
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)
