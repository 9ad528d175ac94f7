"""Random walks through a constraint: tokens drawn uniformly among those a mask allows, the
oracle that what a constrained sampler can produce is what the constraint describes."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import llguidance
import numpy as np


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids whose bit is set in one int32 bitmask row (bit t = token t)."""
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def matcher_mask(matcher: llguidance.LLMatcher, vocab_size: int) -> np.ndarray:
    """The matcher's next-token bitmask, one row, `ceil(vocab_size / 32)` words."""
    words = (vocab_size + 31) // 32
    buf = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
    return buf[:words]


def random_walk(
    mask: Callable[[], np.ndarray],
    accept: Callable[[int], bool],
    vocab_size: int,
    eos_token_ids: Sequence[int],
    rng: random.Random,
    *,
    max_tokens: int = 400,
    eos_prob: float = 0.3,
) -> list[int] | None:
    """Samples token ids uniformly among the allowed ones until EOS is the only choice (or is
    drawn, with probability `eos_prob` where it is allowed); the ids before EOS, or None when
    the walk ran past `max_tokens`. Asserts that every mask allows something."""
    eos = set(eos_token_ids)
    out: list[int] = []
    for _ in range(max_tokens):
        ids = allowed_ids(mask(), vocab_size)
        assert len(ids) > 0, f"the mask allows nothing after {out}"
        choices = [int(t) for t in ids if int(t) not in eos]
        if len(choices) < len(ids) and (not choices or rng.random() < eos_prob):
            return out
        token = rng.choice(choices)
        assert accept(token), f"the grammar rejected token {token}, which its mask allowed"
        out.append(token)
    return None
