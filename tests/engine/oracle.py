"""The correctness oracle: transformers' greedy `generate`, compared token for token."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

# Where transformers' two best logits are closer than this, float rounding (different summation
# orders in the two implementations) may pick either token; the comparison then accepts either
# and stops at that position, since the continuations legitimately diverge from there.
NEAR_TIE = 1e-4


@cache
def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # compare whole sequences, as ignore_eos does
    return model


def hf_greedy(path: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and its per-step logits [max_tokens, vocab]."""
    model = hf_model(path)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat(out.logits).float()


def assert_greedy_matches(path: Path, prompt: list[int], ours: list[int]) -> int:
    """Asserts `ours` equals transformers' greedy output up to the first near-tie.

    Returns how many tokens were compared before the sequences were allowed to diverge.
    """
    ref, logits = hf_greedy(path, prompt, len(ours))
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a == b:
            continue
        gap = abs(float(logits[i, a] - logits[i, b]))
        assert gap < NEAR_TIE, (
            f"token {i} differs: baton {a}, transformers {b} (logit gap {gap:.2e}); "
            f"baton {ours}, transformers {ref}"
        )
        return i
    return len(ours)
