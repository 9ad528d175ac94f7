"""Per-token detokenization cost: the old re-decoding detokenizer (the baseline, copied below)
against the DecodeStream one, side by side in one run.

One sample's output is fed one token per update, as the engine delivers it, then flushed; the
time covers the detokenizer's construction (the new one seeds its stream with the prompt) and
every update. Outputs of 64, 512 and 2048 tokens of text with accents and emoji, with no stop
strings and with three that never match (checked after every token, the worst case). Columns:

- baseline/hf: the old class over transformers' tokenizer (what the server ran before);
- baseline/tok: the old class over the new `Tokenizer` (the algorithm alone);
- stream: the new `IncrementalDetokenizer`.

    python bench/detokenize.py [--tokenizer MODEL_FOLDER] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.detokenizer import IncrementalDetokenizer
from baton.engine.models.tiny import default_model_path
from baton.tokenizer import load_tokenizer

LENGTHS = (64, 512, 2048)
STOPS = {"none": [], "3 stops": ["\n\nUser:", "<|stop|>", "### End"]}
_REPLACEMENT = "\ufffd"


class BaselineDetokenizer:
    """The baseline: Baton's detokenizer before DecodeStream, kept here only to be measured.

    Each new token is decoded together with a few tokens before it (`prefix_offset`), because a
    token's text can depend on its neighbours; only the part past the previous read point is new
    text. That is two decodes of the tail per token.
    """

    def __init__(
        self, tokenizer: Any, stop: list[str], skip_special_tokens: bool = True, min_tokens: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def update(self, new_token_ids: list[int]) -> str | None:
        for token in new_token_ids:
            self.token_ids.append(token)
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset :])
            if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
                continue
            old_len = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            if self.stop and len(self.token_ids) >= self.min_tokens:
                stop = self._find_stop(old_len)
                if stop is not None:
                    return stop
        return None

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.stop_reason = best[1]
        return best[1]

    def flush(self) -> None:
        if self.stop_reason is None and self.read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset :])
            self.text += full[len(prefix) :]
            self.read_offset = len(self.token_ids)


def _output_text(num_words: int) -> str:
    rng = random.Random(0)
    words = ["the", "relay", "baton", "passes", "naïve", "café", "✓", "漢字", "🎉", "runner", "42,"]
    return " ".join(rng.choice(words) for _ in range(num_words))


def _time_per_token(run: Callable[[], str], num_tokens: int, budget_s: float) -> float:
    """Microseconds of this process's CPU per token, the best of repeats filling about budget_s
    (CPU time and the minimum: the machine is shared, and waiting for a core is not cost)."""
    start = time.process_time()
    run()
    once = time.process_time() - start
    repeats = max(5, min(300, int(budget_s / max(once, 1e-6))))
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best / num_tokens * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokenizer", help="a model folder (default: the cached llama-small benchmark model)"
    )
    parser.add_argument("--budget-s", type=float, default=0.4, help="time per measurement")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    folder = Path(args.tokenizer) if args.tokenizer else default_model_path()
    from transformers import AutoTokenizer  # the baseline's tokenizer only

    tok = load_tokenizer(folder)
    hf = AutoTokenizer.from_pretrained(str(folder))
    prompt = tok.encode("Write about a relay race: " + _output_text(40))
    all_ids = tok.encode(_output_text(4 * max(LENGTHS)), add_special_tokens=False)

    def runner(
        make: Callable[[list[str]], Any], ids: list[int], stop: list[str]
    ) -> Callable[[], str]:
        def run() -> str:
            detok = make(stop)
            for t in ids:
                detok.update([t])
            detok.flush()
            return str(detok.text)

        return run

    makers: dict[str, Callable[[list[str]], Any]] = {
        "baseline/hf": lambda stop: BaselineDetokenizer(hf, stop),
        "baseline/tok": lambda stop: BaselineDetokenizer(tok, stop),
        "stream": lambda stop: IncrementalDetokenizer(tok, stop, prompt_token_ids=prompt),
    }
    print(f"tokenizer: {folder} (vocab {len(tok)}); CPU microseconds per token, best of repeats")
    print(
        f"{'tokens':>6} {'stops':>8} "
        + " ".join(f"{m:>13}" for m in makers)
        + f" {'hf/stream':>10} {'tok/stream':>10}"
    )
    results = []
    for length in LENGTHS:
        ids = all_ids[:length]
        for stop_name, stop in STOPS.items():
            texts = {name: runner(make, ids, stop)() for name, make in makers.items()}
            # A benchmark of wrong outputs measures nothing (the seeded stream may keep the
            # leading space a SentencePiece decoder strips).
            if len({t.removeprefix(" ") for t in texts.values()}) != 1:
                raise SystemExit(f"outputs differ at {length} tokens, {stop_name}")
            us = {
                name: _time_per_token(runner(make, ids, stop), length, args.budget_s)
                for name, make in makers.items()
            }
            print(
                f"{length:>6} {stop_name:>8} "
                + " ".join(f"{us[m]:>13.2f}" for m in makers)
                + f" {us['baseline/hf'] / us['stream']:>9.1f}x"
                + f" {us['baseline/tok'] / us['stream']:>9.1f}x"
            )
            results.append({"tokens": length, "stops": stop_name, "us_per_token": us})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
