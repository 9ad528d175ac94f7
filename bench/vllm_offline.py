"""vLLM's offline `LLM.generate` on a workload file: the other side of bench/throughput.py.

Run by the interpreter of an environment that has vLLM (its CPU build on a CPU machine), never
imported by Baton: `PYTHON bench/vllm_offline.py WORKLOAD.json MODEL --dtype float32`. The
workload is `[[prompt_token_ids, max_tokens], ...]`; it prints one JSON line with output tok/s.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workload", type=Path)
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--memory-utilization", type=float, default=0.5)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    work = json.loads(args.workload.read_text())
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        seed=0,
        # On the CPU backend this is the share of host memory vLLM may take; its default (0.92)
        # refuses to start beside the other processes of a 24 GiB machine. The KV cache is
        # VLLM_CPU_KVCACHE_SPACE (4 GiB unless set), as large as Baton's CPU default.
        gpu_memory_utilization=args.memory_utilization,
    )
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up, as Baton's run has
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(m for _, m in work)
    if produced != expected:
        raise RuntimeError(f"vLLM produced {produced} tokens, the workload asks {expected}")
    print(json.dumps({"vllm_tok_s": produced / elapsed}))


if __name__ == "__main__":
    main()
