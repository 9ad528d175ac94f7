"""Tests for the batched sampler: greedy limits, truncation sets, seeding, penalties, logprobs."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from baton.engine.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p,
)


def make_metadata(batch_size: int, **overrides: object) -> SamplingMetadata:
    """Metadata for `batch_size` temperature-1 rows with nothing else enabled, then `overrides`."""
    fields: dict[str, object] = {
        "temperature": torch.ones(batch_size),
        "all_greedy": False,
        "top_k": None,
        "top_p": None,
        "min_p": None,
        "generators": {},
        "presence_penalty": None,
        "frequency_penalty": None,
        "repetition_penalty": None,
        "prompt_token_ids": [[] for _ in range(batch_size)],
        "output_token_ids": [[] for _ in range(batch_size)],
        "min_tokens_block": {},
        "max_num_logprobs": None,
        "generator": torch.Generator().manual_seed(0),
    }
    fields.update(overrides)
    return SamplingMetadata(**fields)  # type: ignore[arg-type]


def clear_winner_logits(batch_size: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Random logits whose argmax leads the runner-up by at least 1.0, so limits are sharp."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, vocab_size, generator=gen)
    best = logits.argmax(dim=-1)
    logits[torch.arange(batch_size), best] += 1.0
    return logits


def reference_allowed(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """Brute-force set of tokens random sampling may return for one row."""
    scaled = row.double() / temperature
    order = sorted(range(len(row)), key=lambda i: -float(scaled[i]))
    if 0 < top_k < len(row):
        order = order[:top_k]
    if top_p < 1.0:
        nucleus_probs = torch.softmax(scaled[order], dim=0).tolist()
        kept: list[int] = []
        mass = 0.0
        for token, prob in zip(order, nucleus_probs, strict=True):
            kept.append(token)
            mass += prob
            if mass >= top_p:
                break
        order = kept
    probs = torch.softmax(scaled[order], dim=0)
    return {
        t for t, p in zip(order, probs.tolist(), strict=True) if p >= min_p * float(probs.max())
    }


def test_greedy_matches_argmax() -> None:
    """Greedy rows, via the fast path and via the full path, return the argmax of the logits."""
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(dim=-1)
    fast = Sampler()(logits, make_metadata(8, temperature=torch.zeros(8), all_greedy=True))
    full = Sampler()(logits, make_metadata(8, temperature=torch.zeros(8), all_greedy=False))
    assert torch.equal(fast.sampled_token_ids, expected)
    assert torch.equal(full.sampled_token_ids, expected)
    assert fast.logprobs is None and fast.logprob_token_ids is None
    assert fast.sampled_token_ranks is None


@pytest.mark.parametrize("temperature", [1e-2, 1e-3, 1e-4, 2e-5])
def test_low_temperature_matches_greedy(temperature: float) -> None:
    """As temperature approaches 0 (but stays above the greedy cut-off), sampling becomes argmax."""
    logits = clear_winner_logits(64, 100)
    out = Sampler()(logits, make_metadata(64, temperature=torch.full((64,), temperature)))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_one_matches_greedy() -> None:
    """top_k=1 at temperature 1 always returns the argmax."""
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(2))
    out = Sampler()(logits, make_metadata(64, top_k=torch.ones(64, dtype=torch.long)))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_tiny_top_p_matches_greedy() -> None:
    """A top_p far below the top token's probability keeps only the argmax."""
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(3))
    out = Sampler()(logits, make_metadata(64, top_p=torch.full((64,), 1e-6)))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_min_p_one_matches_greedy() -> None:
    """min_p=1 drops every token less likely than the top one."""
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(4))
    out = Sampler()(logits, make_metadata(64, min_p=torch.ones(64)))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_samples_stay_in_top_k() -> None:
    """Over many draws, top_k=k returns only the k most likely tokens, and each of them."""
    k, draws = 5, 4000
    row = torch.randn(40, generator=torch.Generator().manual_seed(5)) * 0.3
    logits = row.expand(draws, -1)
    out = Sampler()(logits, make_metadata(draws, top_k=torch.full((draws,), k)))
    top = set(row.topk(k).indices.tolist())
    assert set(out.sampled_token_ids.tolist()) == top


def test_top_k_top_p_truncation_matches_reference() -> None:
    """The kept set per row equals a brute-force top-k then top-p, with disabled rows untouched."""
    batch_size, vocab_size = 48, 30
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(batch_size, vocab_size, generator=gen) * 2
    top_k = torch.randint(0, vocab_size + 5, (batch_size,), generator=gen)
    top_p = torch.rand(batch_size, generator=gen).clamp(min=0.01)
    top_p[::4] = 1.0
    masked = apply_top_k_top_p(logits.clone(), top_k, top_p)
    for r in range(batch_size):
        kept = set(torch.isfinite(masked[r]).nonzero().flatten().tolist())
        expected = reference_allowed(logits[r], 1.0, int(top_k[r]), float(top_p[r]), 0.0)
        assert kept == expected, f"row {r}"
        # Kept logits are returned unchanged, not renormalised.
        assert torch.equal(masked[r][list(kept)], logits[r][list(kept)])
    disabled = (top_p == 1.0) & ((top_k == 0) | (top_k >= vocab_size))
    assert disabled.any()
    assert torch.equal(masked[disabled], logits[disabled])


def test_top_p_one_keeps_large_vocab_intact() -> None:
    """top_p=1.0 keeps every token even where the float32 cumulative sum reaches 1 early."""
    logits = torch.randn(4, 32_000, generator=torch.Generator().manual_seed(16)) * 3
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([1.0, 0.9, 1.0, 0.5]))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.isinf(masked[[1, 3]]).any()


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    vocab_size=st.integers(2, 16),
    spread=st.floats(0.05, 2.0),
    temperature=st.floats(0.2, 2.0),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 0.99)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.9)),
    seed=st.integers(0, 2**31 - 1),
)
def test_samples_stay_in_allowed_set(
    data: st.DataObject,
    vocab_size: int,
    spread: float,
    temperature: float,
    top_p: float,
    min_p: float,
    seed: int,
) -> None:
    """For random top-k/top-p/min-p/temperature, every draw lies in the brute-force allowed set."""
    ranks = data.draw(st.permutations(range(vocab_size)))
    top_k = data.draw(st.integers(0, vocab_size + 2))
    row = torch.tensor(ranks, dtype=torch.float32) * spread
    allowed = reference_allowed(row, temperature, top_k, top_p, min_p)
    # Skip cases sitting on a float tie at the top-p or min-p cut-off: nudging either threshold
    # must not change the reference set.
    eps = 1e-4
    looser_p, tighter_p = (1.0, 1.0) if top_p == 1.0 else (top_p + eps, top_p - eps)
    looser_min, tighter_min = (0.0, 0.0) if min_p == 0.0 else (min_p - eps, min_p + eps)
    assume(allowed == reference_allowed(row, temperature, top_k, looser_p, looser_min))
    assume(allowed == reference_allowed(row, temperature, top_k, tighter_p, tighter_min))

    draws = 64
    metadata = make_metadata(
        draws,
        temperature=torch.full((draws,), temperature),
        top_k=torch.full((draws,), top_k),
        top_p=torch.full((draws,), top_p),
        min_p=torch.full((draws,), min_p),
        generator=torch.Generator().manual_seed(seed),
    )
    out = Sampler()(row.expand(draws, -1), metadata)
    assert set(out.sampled_token_ids.tolist()) <= allowed


def test_seeded_row_reproducible_across_batches() -> None:
    """A seeded request samples the same tokens alone or at another row of a busier batch."""
    steps, vocab_size, seed = 6, 64, 1234
    step_logits = torch.randn(steps, vocab_size, generator=torch.Generator().manual_seed(7))
    noise = torch.Generator().manual_seed(8)

    alone_gen = torch.Generator().manual_seed(seed)
    alone = []
    for step in range(steps):
        metadata = make_metadata(1, generators={0: alone_gen})
        alone.append(int(Sampler()(step_logits[step : step + 1], metadata).sampled_token_ids[0]))

    busy_gen = torch.Generator().manual_seed(seed)
    other_seeded = torch.Generator().manual_seed(seed + 1)
    busy = []
    for step in range(steps):
        logits = torch.randn(5, vocab_size, generator=noise)
        logits[3] = step_logits[step]
        metadata = make_metadata(
            5,
            # Other rows use top-k, top-p, greedy; the seeded row has them disabled.
            temperature=torch.tensor([0.0, 0.7, 1.3, 1.0, 0.5]),
            top_k=torch.tensor([0, 5, 0, 0, 3]),
            top_p=torch.tensor([1.0, 0.9, 0.5, 1.0, 1.0]),
            generators={1: other_seeded, 3: busy_gen},
            generator=torch.Generator().manual_seed(step + 100),
        )
        busy.append(int(Sampler()(logits, metadata).sampled_token_ids[3]))

    assert busy == alone
    # The seed reproduces a sequence, not a constant: the row really is sampled.
    assert len(set(alone)) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampling_distribution_matches_softmax(temperature: float) -> None:
    """Empirical frequencies of many draws fit softmax(logits / T) under a chi-square test."""
    draws = 30_000
    row = torch.tensor([1.2, 0.3, -0.5, 0.0, 2.0, -1.0])
    metadata = make_metadata(
        draws,
        temperature=torch.full((draws,), temperature),
        generator=torch.Generator().manual_seed(9),
    )
    out = Sampler()(row.expand(draws, -1), metadata)
    observed = torch.bincount(out.sampled_token_ids, minlength=len(row)).double()
    expected = torch.softmax(row.double() / temperature, dim=0) * draws
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    # 99.9th percentile of chi-square with 5 degrees of freedom.
    assert chi_square < 20.52


def reference_penalties(
    logits: torch.Tensor,
    prompts: list[list[int]],
    outputs: list[list[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
) -> torch.Tensor:
    """Per-row, per-token penalties: HF repetition, then OpenAI presence and frequency."""
    out = logits.clone()
    for r in range(len(logits)):
        for token in set(prompts[r]) | set(outputs[r]):
            value = float(out[r, token])
            out[r, token] = value / repetition[r] if value > 0 else value * repetition[r]
        for token in set(outputs[r]):
            out[r, token] -= presence[r] + frequency[r] * outputs[r].count(token)
    return out


@pytest.mark.parametrize("enabled", [("presence",), ("frequency",), ("repetition",), ("all",)])
def test_penalties_match_reference(enabled: tuple[str, ...]) -> None:
    """Penalised logits equal a per-row reference for each penalty alone and all together."""
    batch_size, vocab_size = 6, 25
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(batch_size, vocab_size, generator=gen) * 3
    lengths = [0, 1, 7, 12, 3, 20]
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths[::-1]]
    outputs = [torch.randint(0, 8, (n,), generator=gen).tolist() for n in lengths]
    presence = torch.tensor([0.0, 0.5, -0.3, 1.0, 2.0, 0.1])
    frequency = torch.tensor([0.2, 0.0, 0.4, -0.1, 1.5, 0.3])
    repetition = torch.tensor([1.0, 1.3, 0.8, 2.0, 1.1, 1.5])
    use = {
        name: "all" in enabled or name in enabled
        for name in ("presence", "frequency", "repetition")
    }
    metadata = make_metadata(
        batch_size,
        presence_penalty=presence if use["presence"] else None,
        frequency_penalty=frequency if use["frequency"] else None,
        repetition_penalty=repetition if use["repetition"] else None,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
    )
    expected = reference_penalties(
        logits,
        prompts,
        outputs,
        presence.tolist() if use["presence"] else [0.0] * batch_size,
        frequency.tolist() if use["frequency"] else [0.0] * batch_size,
        repetition.tolist() if use["repetition"] else [1.0] * batch_size,
    )
    torch.testing.assert_close(apply_penalties(logits.clone(), metadata), expected)


def test_penalties_steer_greedy_choice() -> None:
    """A greedy row with a large presence penalty stops repeating its favourite token."""
    logits = torch.tensor([[3.0, 2.5, 0.0], [3.0, 2.5, 0.0]])
    metadata = make_metadata(
        2,
        temperature=torch.zeros(2),
        all_greedy=True,
        presence_penalty=torch.tensor([1.0, 0.0]),
        output_token_ids=[[0], [0]],
    )
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [1, 0]


def test_min_tokens_block_never_sampled() -> None:
    """Blocked ids are never returned, even when they are the most likely tokens."""
    draws, vocab_size = 2000, 10
    row = torch.zeros(vocab_size)
    row[[2, 7]] = 5.0  # the blocked ids would otherwise win almost every draw
    blocked = {r: [2, 7] for r in range(draws)}
    temperature = torch.ones(draws)
    temperature[::2] = 0.0
    metadata = make_metadata(draws, temperature=temperature, min_tokens_block=blocked)
    sampled = Sampler()(row.expand(draws, -1), metadata).sampled_token_ids
    assert not set(sampled.tolist()) & {2, 7}
    assert len(set(sampled[1::2].tolist())) > 1


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_come_from_raw_logits(k: int) -> None:
    """Logprobs are raw log_softmax values: sampled token first, top-k sorted, ranks exact."""
    batch_size, vocab_size = 16, 20
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(batch_size, vocab_size, generator=gen).to(torch.bfloat16)
    temperature = torch.full((batch_size,), 0.8)
    temperature[:4] = 0.0
    metadata = make_metadata(
        batch_size,
        temperature=temperature,
        top_k=torch.full((batch_size,), 8),
        presence_penalty=torch.full((batch_size,), 0.7),
        output_token_ids=[[1, 2, 2]] * batch_size,
        max_num_logprobs=k,
    )
    out = Sampler()(logits, metadata)
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.sampled_token_ranks is not None
    assert out.logprob_token_ids.shape == (batch_size, k + 1)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64

    raw = torch.log_softmax(logits.float(), dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.logprob_token_ids))
    top = out.logprobs[:, 1:]
    assert torch.all(top[:, :-1] >= top[:, 1:])
    if k:
        torch.testing.assert_close(top[:, 0], raw.max(dim=-1).values)
    expected_ranks = [1 + int((raw[r] > raw[r, sampled[r]]).sum()) for r in range(batch_size)]
    assert out.sampled_token_ranks.tolist() == expected_ranks


def test_greedy_batch_with_logprobs() -> None:
    """An all-greedy batch that asks for logprobs returns argmax with rank 1, even on ties."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(12))
    logits[0, :2] = 9.0  # a tie for first place must not push the greedy pick to rank 2
    metadata = make_metadata(4, temperature=torch.zeros(4), all_greedy=True, max_num_logprobs=2)
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ranks is not None and out.logprob_token_ids is not None
    assert out.sampled_token_ranks.tolist() == [1, 1, 1, 1]
    assert out.logprobs is not None
    assert torch.equal(out.logprobs[:, 0], out.logprobs[:, 1])


def test_mixed_greedy_and_random_batch() -> None:
    """In one batch greedy rows return argmax while random rows sample within their top-k."""
    batch_size, vocab_size, steps = 8, 50, 30
    logits = torch.randn(batch_size, vocab_size, generator=torch.Generator().manual_seed(13))
    greedy = torch.tensor([True, False] * 4)
    metadata = make_metadata(
        batch_size,
        temperature=torch.where(greedy, 0.0, 1.5),
        top_k=torch.where(greedy, 0, 4),
        generator=torch.Generator().manual_seed(14),
    )
    top4 = logits.topk(4).indices
    seen_random: set[int] = set()
    for _ in range(steps):
        sampled = Sampler()(logits, metadata).sampled_token_ids
        assert torch.equal(sampled[greedy], logits.argmax(dim=-1)[greedy])
        for r in (~greedy).nonzero().flatten().tolist():
            assert int(sampled[r]) in top4[r].tolist()
            seen_random.add(int(sampled[r]))
    assert len(seen_random) > len(top4[~greedy].unique()) // 2


def test_caller_logits_untouched() -> None:
    """The sampler never modifies the logits tensor it is given."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(15))
    before = logits.clone()
    metadata = make_metadata(
        4,
        top_k=torch.full((4,), 3),
        top_p=torch.full((4,), 0.5),
        min_p=torch.full((4,), 0.1),
        repetition_penalty=torch.full((4,), 1.2),
        output_token_ids=[[0, 1]] * 4,
        min_tokens_block={0: [5]},
        max_num_logprobs=2,
    )
    Sampler()(logits, metadata)
    assert torch.equal(logits, before)


def test_rejects_mismatched_inputs() -> None:
    """Shape mismatches and too many logprobs raise ValueError, not silent garbage."""
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="temperature"):
        Sampler()(logits, make_metadata(2))
    with pytest.raises(ValueError, match="max_num_logprobs"):
        Sampler()(logits, make_metadata(3, max_num_logprobs=11))
    with pytest.raises(ValueError, match="output_token_ids"):
        Sampler()(logits, make_metadata(3, presence_penalty=torch.ones(3), output_token_ids=[]))


# ---- the grammar bitmask, allowed_token_ids, bad words, logit_bias (vLLM V1's order) ---------


def _bitmask(allowed_rows: list[list[int]], vocab_size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 with bit t of row i set for each t in allowed_rows[i]."""
    words = (vocab_size + 31) // 32
    mask = torch.zeros(len(allowed_rows), words * 32, dtype=torch.bool)
    for i, allowed in enumerate(allowed_rows):
        mask[i, allowed] = True
    bits = mask.view(len(allowed_rows), words, 32).to(torch.int64)
    packed = (bits << torch.arange(32)).sum(-1)  # unsigned 32-bit words
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.parametrize("all_greedy", [True, False])
def test_token_bitmask_restricts_every_path(all_greedy: bool) -> None:
    """Greedy (fast path included) and random rows only ever pick a token whose bit is set,
    including token 31 (the sign bit of a word) and the last, partial word."""
    vocab, batch = 70, 64
    logits = clear_winner_logits(batch, vocab, seed=5)
    allowed = [[31, 69], [0], [33, 40, 63], [64]] * (batch // 4)
    temperature = torch.zeros(batch) if all_greedy else torch.ones(batch)
    out = Sampler()(
        logits,
        make_metadata(
            batch,
            temperature=temperature,
            all_greedy=all_greedy,
            token_bitmask=_bitmask(allowed, vocab),
        ),
    )
    for row, token in enumerate(out.sampled_token_ids.tolist()):
        assert token in allowed[row]
    if all_greedy:
        for row, token in enumerate(out.sampled_token_ids.tolist()):
            assert token == max(allowed[row], key=lambda t: float(logits[row, t]))


def test_token_bitmask_rows_unpack_only_the_constrained_rows() -> None:
    """With `token_bitmask_rows`, only those rows are masked (the others' words are not even
    read: here they say "nothing allowed", which would be wrong for them), and the caller's
    logits stay as they were."""
    vocab, batch = 70, 4
    logits = clear_winner_logits(batch, vocab, seed=7)
    before = logits.clone()
    mask = _bitmask([[], [5], [], [64, 66]], vocab)
    meta = make_metadata(batch, temperature=torch.zeros(batch), token_bitmask=mask)
    meta.token_bitmask_rows = torch.tensor([1, 3])
    out = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert out[1] == 5 and out[3] in (64, 66)
    assert torch.equal(logits, before)


def test_token_bitmask_all_ones_changes_nothing_and_logprobs_see_it() -> None:
    """An all-ones row samples as without a mask; a masked token's logprob is -inf, since vLLM
    applies the bitmask before the sampler takes its raw logprobs."""
    vocab = 50
    logits = clear_winner_logits(2, vocab, seed=6)
    mask = _bitmask([list(range(vocab)), [7, 9]], vocab)
    meta = make_metadata(2, temperature=torch.zeros(2), token_bitmask=mask, max_num_logprobs=2)
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert set(out.logprob_token_ids[1].tolist()) <= {7, 9}
    masked = torch.log_softmax(logits[1].masked_fill(~_allowed_row([7, 9], vocab), -1e30), -1)
    assert out.logprobs[1, 0] == pytest.approx(float(masked[out.sampled_token_ids[1]]), abs=1e-5)


def _allowed_row(ids: list[int], vocab: int) -> torch.Tensor:
    row = torch.zeros(vocab, dtype=torch.bool)
    row[ids] = True
    return row


def test_logit_bias_plus_100_forces_and_minus_100_bans() -> None:
    """+100 makes a token the greedy pick; -100 on the argmax moves the pick to the runner-up."""
    vocab = 40
    logits = clear_winner_logits(3, vocab, seed=7)
    best = logits.argmax(-1)
    second = logits.topk(2, -1).indices[:, 1]
    bias = (torch.tensor([0, 1]), torch.tensor([5, int(best[1])]), torch.tensor([100.0, -100.0]))
    out = Sampler()(logits, make_metadata(3, temperature=torch.zeros(3), logit_bias=bias))
    assert out.sampled_token_ids.tolist() == [5, int(second[1]), int(best[2])]


def test_logit_bias_comes_before_penalties_and_not_in_logprobs() -> None:
    """vLLM: logit_bias is added before penalties (a repetition penalty divides the biased
    logit), and logprobs are of the raw logits."""
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    bias = (torch.tensor([0]), torch.tensor([0]), torch.tensor([3.0]))  # token 0: 4.0
    meta = make_metadata(
        1,
        temperature=torch.zeros(1),
        logit_bias=bias,
        repetition_penalty=torch.tensor([2.5]),  # 4.0 / 2.5 = 1.6 < 2.0: token 1 wins
        output_token_ids=[[0]],
        prompt_token_ids=[[]],
        max_num_logprobs=0,
    )
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [1]
    assert out.logprobs is not None
    assert float(out.logprobs[0, 0]) == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))


def test_allowed_token_ids_restrict_sampling() -> None:
    """Rows with allowed_token_ids only sample from that set, others are untouched."""
    vocab, batch = 64, 32
    logits = clear_winner_logits(batch, vocab, seed=8)
    rows = torch.arange(0, batch, 2)
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)
    allowed[:, [3, 17, 42]] = True
    out = Sampler()(logits, make_metadata(batch, allowed_token_ids=(rows, allowed)))
    for row, token in enumerate(out.sampled_token_ids.tolist()):
        if row % 2 == 0:
            assert token in {3, 17, 42}
    greedy = Sampler()(
        logits,
        make_metadata(batch, temperature=torch.zeros(batch), allowed_token_ids=(rows, allowed)),
    )
    expect = logits.argmax(-1)
    expect[rows] = torch.tensor([3, 17, 42])[logits[rows][:, [3, 17, 42]].argmax(-1)]
    assert greedy.sampled_token_ids.tolist() == expect.tolist()


def test_bad_words_block_is_minus_inf() -> None:
    """The runner's (row, token) bad-word pairs are never sampled."""
    vocab = 20
    logits = clear_winner_logits(2, vocab, seed=9)
    best = logits.argmax(-1)
    block = (torch.tensor([0, 1]), best.clone())
    out = Sampler()(logits, make_metadata(2, temperature=torch.zeros(2), bad_words_block=block))
    assert (out.sampled_token_ids != best).all()
