"""`baton demo`: offline generation with `LLM` on a model (default: the built-in one)."""

from __future__ import annotations

import argparse
import time


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)


def run(args: argparse.Namespace) -> int:
    from baton import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len)
    prompts = [
        "The relay team passed the baton",
        "Disaggregated serving splits prefill and decode so that",
        "Paged attention stores the KV cache in blocks",
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print(f"prompt: {out.prompt!r}\n  -> {out.outputs[0].text!r}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.0f} tok/s)")
    print(f"model: {llm.engine.model_path} (a randomly initialised model: the text is noise)")
    return 0
