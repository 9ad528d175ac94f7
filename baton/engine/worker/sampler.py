"""Turn one step's logits into next tokens: the grammar mask, allowed tokens, bad words, logit bias,
penalties, temperature, top-k/top-p/min-p, logprobs.

The order is vLLM V1's (vllm/v1/sample/sampler.py and the runner's grammar bitmask before it): the
grammar bitmask first, then the raw logprobs are taken, then allowed_token_ids, bad words,
min_tokens and logit_bias, penalties, and only then temperature and the truncations. So logprobs
see the grammar (a forbidden token is -inf) but not the other processors.

One row per request sampled this step. Everything is vectorised over the batch; the only
per-row Python work is drawing noise from a seeded request's own generator and flattening the
token-id lists that penalties count.

Random rows use the exponential race: ``argmax(probs / q)`` with ``q ~ Exponential(1)`` picks
token ``i`` with probability ``probs[i]``, needs no cumulative sum, and lets every seeded row draw
its ``q`` from its own generator, so a seeded request samples the same tokens whatever else shares
its batch.
"""

import itertools
from dataclasses import dataclass

import torch

# Rows below this temperature are greedy: OpenAI treats 0 as argmax, and dividing by ~0 overflows.
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingMetadata:
    """What the sampler needs for one step; built by the model runner, row i = request i."""

    # [B] float32; rows below 1e-5 are greedy.
    temperature: torch.Tensor
    # Every row greedy: after the logits processors (penalties, bias, bans), the argmax is all
    # there is to do; with none of them and no logprobs, the argmax of the raw logits.
    all_greedy: bool
    # [B] int64; 0 or >= vocab disables it for that row. None when no row uses top-k.
    top_k: torch.Tensor | None
    # [B] float32 in (0, 1]; 1.0 disables it for that row. None when no row uses top-p.
    top_p: torch.Tensor | None
    # [B] float32 in [0, 1]; 0.0 disables it for that row. None when no row uses min-p.
    min_p: torch.Tensor | None
    # Row index -> that request's own generator (requests with a seed), on the logits' device.
    generators: dict[int, torch.Generator]
    # [B] float32; None when every row's is 0.
    presence_penalty: torch.Tensor | None
    # [B] float32; None when every row's is 0.
    frequency_penalty: torch.Tensor | None
    # [B] float32; None when every row's is 1.0.
    repetition_penalty: torch.Tensor | None
    # Per row; read only by the repetition penalty.
    prompt_token_ids: list[list[int]]
    # Per row: tokens generated so far; read by all three penalties.
    output_token_ids: list[list[int]]
    # Row -> token ids forbidden this step (EOS and stop ids while the output is below min_tokens).
    min_tokens_block: dict[int, list[int]]
    # Largest `logprobs` any row asked for; None when no row wants logprobs.
    max_num_logprobs: int | None
    # Shared generator for random rows without a seed; None means torch's default generator.
    generator: torch.Generator | None = None
    # [B, ceil(V/32)] int32, bit t of row i set = token t allowed (the grammar's mask); a row
    # with no constraint is all ones. None when no row is constrained.
    token_bitmask: torch.Tensor | None = None
    # [R] int64: the rows `token_bitmask` constrains (only they are unpacked, 32 ints a word:
    # on 256 rows of a 152k vocabulary all rows cost ~185 ms on a CPU); None: every row.
    token_bitmask_rows: torch.Tensor | None = None
    # Rows restricted to `allowed_token_ids`: ([R] int64 rows, [R, V] bool, True = allowed).
    # None when no row restricts.
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids) to forbid this step for bad words, already matched against each row's
    # output by the runner ([N] int64 each); None when none applies this step.
    bad_words_block: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids, biases) of every row's logit_bias ([N] int64, int64, float32); None when
    # no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def has_processors(self) -> bool:
        """Whether anything besides the grammar changes the logits before sampling."""
        return (
            _needs_penalties(self)
            or bool(self.min_tokens_block)
            or self.allowed_token_ids is not None
            or self.bad_words_block is not None
            or self.logit_bias is not None
        )


@dataclass
class SamplerOutput:
    """One step's sampled tokens and, when asked for, their logprobs."""

    # [B] int64
    sampled_token_ids: torch.Tensor
    # [B, k + 1] int64: column 0 is the sampled token, then the k most likely ids, best first.
    logprob_token_ids: torch.Tensor | None
    # [B, k + 1] float32, log_softmax of the raw logits at logprob_token_ids.
    logprobs: torch.Tensor | None
    # [B] int64: 1 + the number of tokens strictly more likely than the sampled one.
    sampled_token_ranks: torch.Tensor | None


class Sampler:
    """Stateless; called once per step by the model runner. Never modifies the caller's logits."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` ([B, vocab]) as `metadata` asks."""
        _check_shapes(logits, metadata)
        k = metadata.max_num_logprobs
        if metadata.token_bitmask is not None:
            # Out of place: the caller's logits stay untouched, and this is the float32 copy.
            logits = logits.to(torch.float32, copy=True)
            rows = metadata.token_bitmask_rows
            if rows is None:
                logits = apply_token_bitmask(logits, metadata.token_bitmask)
            else:
                logits[rows] = apply_token_bitmask(logits[rows], metadata.token_bitmask[rows])
        # all_greedy promises no processors, but checking costs nothing and stays correct.
        if metadata.all_greedy and k is None and not metadata.has_processors:
            return SamplerOutput(logits.argmax(dim=-1), None, None, None)

        # One float32 copy we may modify in place, whatever dtype the model produced.
        if metadata.token_bitmask is None:
            logits = logits.to(torch.float32, copy=True)  # [B, V]
        # Logprobs describe the model, not the sampling parameters, so they come from raw logits.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if k is not None else None

        if metadata.allowed_token_ids is not None:
            rows, allowed = metadata.allowed_token_ids
            logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
        if metadata.bad_words_block is not None:
            rows, cols = metadata.bad_words_block
            logits[rows, cols] = float("-inf")
        if metadata.min_tokens_block:
            apply_min_tokens_block(logits, metadata.min_tokens_block)
        if metadata.logit_bias is not None:
            rows, cols, bias = metadata.logit_bias
            logits.index_put_((rows, cols), bias, accumulate=True)
        if _needs_penalties(metadata):
            apply_penalties(logits, metadata)

        greedy_tokens = logits.argmax(dim=-1)  # [B]
        if metadata.all_greedy:
            sampled = greedy_tokens
        else:
            is_greedy = metadata.temperature < _GREEDY_TEMPERATURE  # [B]
            # Greedy rows still go through the random path (no sync to split the batch); a
            # temperature of 1 keeps their arithmetic finite and their result is discarded.
            temperature = torch.where(is_greedy, 1.0, metadata.temperature)
            logits.div_(temperature.unsqueeze(1))
            if metadata.top_k is not None or metadata.top_p is not None:
                apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
            if metadata.min_p is not None:
                apply_min_p(logits, metadata.min_p)
            probs = torch.softmax(logits, dim=-1)
            random_tokens = random_sample(probs, metadata.generators, metadata.generator)
            sampled = torch.where(is_greedy, greedy_tokens, random_tokens)

        if raw_logprobs is None or k is None:
            return SamplerOutput(sampled, None, None, None)
        token_ids, logprobs, ranks = gather_logprobs(raw_logprobs, sampled, k)
        return SamplerOutput(sampled, token_ids, logprobs, ranks)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Return `logits` with every token whose bit is clear set to -inf (a new tensor).

    Bit t of a row lives at word t // 32, bit t % 32 (llguidance's and xgrammar's layout).
    """
    batch_size, vocab_size = logits.shape
    words = bitmask.to(device=logits.device, dtype=torch.int32)
    if words.shape != (batch_size, (vocab_size + 31) // 32):
        raise ValueError(
            f"token_bitmask must have shape ({batch_size}, {(vocab_size + 31) // 32}) for logits "
            f"of shape {tuple(logits.shape)}, got {tuple(words.shape)}"
        )
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    # A sign bit's arithmetic shift fills with ones, but `& 1` keeps only the bit asked for.
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(batch_size, -1)
    return torch.where(allowed[:, :vocab_size], logits, float("-inf"))


def apply_min_tokens_block(logits: torch.Tensor, block: dict[int, list[int]]) -> torch.Tensor:
    """Set each row's blocked token ids to -inf in place; returns `logits`."""
    lengths = torch.tensor([len(ids) for ids in block.values()])
    rows = torch.repeat_interleave(torch.tensor(list(block.keys())), lengths)
    cols = torch.tensor(list(itertools.chain.from_iterable(block.values())), dtype=torch.long)
    logits[rows.to(logits.device), cols.to(logits.device)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Apply repetition, then presence and frequency penalties to float32 `logits` in place.

    Repetition follows Hugging Face (prompt and output tokens; divide positive logits, multiply
    negative ones). Presence and frequency follow OpenAI (output tokens only;
    ``logit -= presence * (count > 0) + frequency * count``). Returns `logits`.
    """
    vocab_size = logits.shape[-1]
    output_counts = _token_counts(metadata.output_token_ids, vocab_size, logits.device)  # [B, V]

    if metadata.repetition_penalty is not None:
        prompt_counts = _token_counts(metadata.prompt_token_ids, vocab_size, logits.device)
        seen = (prompt_counts > 0) | (output_counts > 0)  # [B, V]
        penalty = metadata.repetition_penalty.to(torch.float32).unsqueeze(1)  # [B, 1]
        scale = torch.where(logits > 0, 1.0 / penalty, penalty)
        logits.mul_(scale.masked_fill_(~seen, 1.0))

    if metadata.frequency_penalty is not None:
        logits.sub_(metadata.frequency_penalty.to(torch.float32).unsqueeze(1) * output_counts)
    if metadata.presence_penalty is not None:
        presence = metadata.presence_penalty.to(torch.float32).unsqueeze(1)
        logits.sub_(presence * (output_counts > 0))
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set tokens outside each row's top-k, then outside its top-p nucleus, to -inf in place.

    Top-k keeps exactly k tokens (ties broken by sort order); k <= 0 or k >= vocab disables it.
    Top-p then keeps the smallest most-likely-first set whose renormalised probability reaches
    p, always at least one token; p >= 1 disables it. Returns `logits`.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [B, V] each
    positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, V]

    if top_k is not None:
        k = top_k.to(device=logits.device, dtype=torch.long)
        k = torch.where((k <= 0) | (k >= vocab_size), vocab_size, k).unsqueeze(1)  # [B, 1]
        sorted_logits.masked_fill_(positions >= k, float("-inf"))

    if top_p is not None:
        p = top_p.to(device=logits.device, dtype=torch.float32).unsqueeze(1)  # [B, 1]
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Probability mass strictly ahead of each token: a token is needed while that is < p.
        # The first token's is 0, so at least one survives. Rows with p >= 1 are exempt because
        # float32 cumsums can reach 1 before the tail and would drop tokens they should keep.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits.masked_fill_((mass_before >= p) & (p < 1.0), float("-inf"))

    return logits.scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set tokens with probability below min_p times the row's top probability to -inf in place."""
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    threshold = min_p.to(device=logits.device, dtype=torch.float32).unsqueeze(1)
    threshold = threshold * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill_(probs < threshold, float("-inf"))


def random_sample(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Draw one token per row of `probs` ([B, V]) by the exponential race; returns [B] int64.

    Row i's noise comes from ``generators[i]`` when present, so a seeded row's draws depend only
    on its own generator; every other row shares `generator`. Overwrites nothing in `probs`.
    """
    q = torch.empty_like(probs)  # [B, V]
    if len(generators) < probs.shape[0]:
        q.exponential_(generator=generator)
    for row, row_generator in generators.items():
        q[row].exponential_(generator=row_generator)
    # An exact 0 from exponential_ would turn a masked token's 0/0 into NaN, which argmax picks.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ([B, k+1] ids, [B, k+1] logprobs, [B] ranks): sampled token first, then top-k."""
    vocab_size = raw_logprobs.shape[-1]
    if not 0 <= k <= vocab_size:
        raise ValueError(f"max_num_logprobs must be in [0, {vocab_size}] (the vocab size), got {k}")
    sampled_ids = sampled.unsqueeze(1)  # [B, 1]
    sampled_logprobs = raw_logprobs.gather(1, sampled_ids)  # [B, 1]
    # Strictly greater, so a greedy pick is rank 1 even when another token ties it.
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1  # [B]
    if k == 0:
        return sampled_ids, sampled_logprobs, ranks
    top_logprobs, top_ids = raw_logprobs.topk(k, dim=-1)  # [B, k], most likely first
    token_ids = torch.cat([sampled_ids, top_ids], dim=1)
    logprobs = torch.cat([sampled_logprobs, top_logprobs], dim=1)
    return token_ids, logprobs, ranks


def _token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Count each row's token ids into a [B, vocab_size] float32 tensor with one scatter_add."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long)  # [B]
    max_len = int(lengths.max()) if len(token_ids) else 0
    # Padding points at an extra column past the vocab, dropped after the scatter, so ragged
    # rows need no masking inside the scatter.
    padded = torch.full((len(token_ids), max_len), vocab_size, dtype=torch.long)  # [B, L]
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long)
    padded[torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)] = flat
    padded = padded.to(device)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _check_shapes(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Raise ValueError when the runner's logits and metadata disagree on the batch."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch_size = logits.shape[0]
    if metadata.temperature.shape != (batch_size,):
        raise ValueError(
            f"temperature must have shape ({batch_size},) to match the logits, "
            f"got {tuple(metadata.temperature.shape)}"
        )
    if metadata.allowed_token_ids is not None:
        rows, allowed = metadata.allowed_token_ids
        if allowed.shape != (rows.shape[0], logits.shape[1]):
            raise ValueError(
                f"allowed_token_ids mask must have shape ({rows.shape[0]}, {logits.shape[1]}), "
                f"got {tuple(allowed.shape)}"
            )
    if _needs_penalties(metadata) and len(metadata.output_token_ids) != batch_size:
        raise ValueError(
            f"output_token_ids has {len(metadata.output_token_ids)} rows, logits have {batch_size}"
        )
    if metadata.repetition_penalty is not None and len(metadata.prompt_token_ids) != batch_size:
        raise ValueError(
            f"prompt_token_ids has {len(metadata.prompt_token_ids)} rows, logits have {batch_size}"
        )


def _needs_penalties(metadata: SamplingMetadata) -> bool:
    """Whether any row has a presence, frequency or repetition penalty this step."""
    return (
        metadata.presence_penalty is not None
        or metadata.frequency_penalty is not None
        or metadata.repetition_penalty is not None
    )
