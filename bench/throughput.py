"""Offline throughput: Baton's `LLM.generate` against transformers' batched `generate`.

Same model (the `small` benchmark model by default), same seeded workload, same process:
256 requests, random prompt token ids, prompt lengths uniform in 32..512, max_tokens uniform in
32..256, ignore_eos, greedy. Prints output tokens/s for both and their ratio.

    python bench/throughput.py [--model PATH] [--num-requests 256] [--skip-hf] [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton import LLM, SamplingParams
from baton.engine.models.tiny import default_model_path

VLLM_CPU_REFERENCE = 890.0  # vLLM 0.32 CPU build, this workload and model, on the 2-core machine


def make_workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        prompt_len = rng.randint(32, 512)
        max_tokens = rng.randint(32, 256)
        work.append(([rng.randrange(vocab) for _ in range(prompt_len)], max_tokens))
    return work


def run_baton(model: str, work: list[tuple[list[int], int]], args: argparse.Namespace) -> float:
    llm = LLM(
        model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        async_scheduling=args.async_scheduling,
    )
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
    llm.generate(prompts[:4], params[:4])  # warm-up
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(m for _, m in work)
    if produced != expected:
        raise RuntimeError(f"Baton produced {produced} tokens, the workload asks {expected}")
    return produced / elapsed


def run_transformers(
    model: str, work: list[tuple[list[int], int]], args: argparse.Namespace
) -> float:
    from transformers import AutoModelForCausalLM

    device = "cuda" if args.device == "cuda" else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(model).to(device).eval()
    # Batches of similar prompt length, left-padded: the fair way to batch `generate`.
    order = sorted(range(len(work)), key=lambda i: len(work[i][0]))
    start = time.perf_counter()
    produced = 0
    for b in range(0, len(order), args.hf_batch_size):
        batch = [work[i] for i in order[b : b + args.hf_batch_size]]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        max_new = max(m for _, m in batch)
        with torch.inference_mode():
            hf.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
        produced += sum(m for _, m in batch)  # only the tokens the workload asked for count
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the small model)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile Baton's run")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    model = args.model or str(default_model_path())
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    work = make_workload(args.num_requests, vocab, args.seed)
    print(f"model {model}, {len(work)} requests, {sum(m for _, m in work)} output tokens")
    result: dict[str, float] = {"baton_tok_s": run_baton(model, work, args)}
    print(f"baton         {result['baton_tok_s']:9.1f} output tok/s")
    if not args.skip_hf:
        result["transformers_tok_s"] = run_transformers(model, work, args)
        result["ratio_vs_transformers"] = result["baton_tok_s"] / result["transformers_tok_s"]
        print(f"transformers  {result['transformers_tok_s']:9.1f} output tok/s")
        print(f"ratio         {result['ratio_vs_transformers']:9.2f}x baton / transformers")
    if args.device == "cpu":
        result["ratio_vs_vllm_cpu_reference"] = result["baton_tok_s"] / VLLM_CPU_REFERENCE
        print(
            f"vs vLLM CPU   {result['ratio_vs_vllm_cpu_reference']:9.2f}x "
            f"(reference {VLLM_CPU_REFERENCE:.0f} tok/s measured on the 2-core machine)"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
