"""Constrained streams under load: what grammars cost the requests that use none.

One `baton engine` of the `small` benchmark model, 128 concurrent streamed completions per round:
64 "free" ones (the measured group) and 64 "other" ones. In the baseline round the other 64 are
unconstrained too; in the constrained round they carry a grammar. Both rounds run the same prompts
and lengths (`max_tokens` fixed, `ignore_eos`; the grammar, a regex no answer can finish, never ends
a request early), so the batch is the same and the only difference is the grammar's work: compiling,
the per-step bitmask and the tokens it advances. Rounds alternate (baseline, constrained, ...) so
that a machine busy elsewhere slows both alike. Prints the free group's output tok/s per round and
the ratio constrained / baseline (the aim: above 0.9).

A last round sends 64 JSON-schema streams beside 64 free ones with no fixed length: every answer
must validate against its schema (`jsonschema`) and every stream end (nothing hangs).

    python bench/structured_load.py [--rounds 2] [--streams 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.models.tiny import write_tiny_model

# No answer finishes this pattern within the benchmark's lengths: the constrained requests run
# exactly as long as their free twins, while every token they sample is masked by the grammar.
ENDLESS_REGEX = "[a-z ,.]{4000}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engine:
    def __init__(self, model: Path, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "engine",
               "--model", str(model), "--port", str(self.port), "--max-num-seqs", "256",
               "--max-model-len", "1024"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the engine did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self._log.close()


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, int, str | None]:
    """The streamed text, its token count (from usage) and the finish reason."""
    text, tokens, finish = [], 0, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            for choice in chunk["choices"]:
                text.append(choice["text"])
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return "".join(text), tokens, finish


def _body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def fixed_round(url: str, prompts: list[str], max_tokens: int, constrained: bool) -> float:
    """Output tok/s of the free half while the other half runs (constrained or not)."""
    half = len(prompts) // 2
    other: dict[str, Any] = {"ignore_eos": True}
    if constrained:
        other["structured_outputs"] = {"regex": ENDLESS_REGEX}
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        start = time.perf_counter()
        free_done: list[float] = []

        async def free(p: str) -> int:
            _, n, _ = await _stream(client, _body(p, max_tokens, ignore_eos=True))
            free_done.append(time.perf_counter())
            return n

        results = await asyncio.gather(
            *(free(p) for p in prompts[:half]),
            *(_stream(client, _body(p, max_tokens, **other)) for p in prompts[half:]),
        )
    free_tokens = sum(results[:half])  # type: ignore[arg-type]
    for _, n, finish in results[half:]:  # type: ignore[misc]
        assert finish == "length" and n == max_tokens, (finish, n)
    return free_tokens / (max(free_done) - start)


async def schema_round(url: str, prompts: list[str], max_tokens: int) -> tuple[int, int, float]:
    """(valid, total, seconds) for JSON-schema streams beside free ones."""
    half = len(prompts) // 2
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(_stream(client, _body(p, max_tokens)) for p in prompts[:half]),
            *(
                _stream(client, _body(p, 4 * max_tokens, response_format=response_format))
                for p in prompts[half:]
            ),
        )
    valid = 0
    for text, _, finish in results[half:]:
        if finish == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
    return valid, len(results) - half, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=64, help="streams per group")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    rng = random.Random(0)
    words = ["relay", "baton", "runner", "zone", "hand", "pass", "track", "lane", "team"]
    prompts = [" ".join(rng.choices(words, k=rng.randint(8, 40))) for _ in range(2 * args.streams)]
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "model", "llama", "small")
        engine = Engine(model, Path(tmp) / "engine.log")
        try:
            engine.wait_ready()
            # Warm up both paths (the first grammar of a kind compiles the tokenizer's tables).
            asyncio.run(fixed_round(engine.url, prompts[:8], 8, constrained=True))
            base: list[float] = []
            constrained: list[float] = []
            for _ in range(args.rounds):
                base.append(asyncio.run(fixed_round(engine.url, prompts, args.max_tokens, False)))
                constrained.append(
                    asyncio.run(fixed_round(engine.url, prompts, args.max_tokens, True))
                )
            valid, total, seconds = asyncio.run(schema_round(engine.url, prompts, args.max_tokens))
        finally:
            engine.stop()
    print(f"free group: {args.streams} streams x {args.max_tokens} tokens, beside {args.streams} "
          "others (same run, rounds alternated)")  # fmt: skip
    print(f"{'round':>6} {'others free tok/s':>18} {'others constrained tok/s':>25} {'ratio':>6}")
    for i, (b, c) in enumerate(zip(base, constrained, strict=True)):
        print(f"{i:>6} {b:>18.1f} {c:>25.1f} {c / b:>6.2f}")
    ratio = sum(constrained) / sum(base)
    print(f"mean ratio (constrained / free): {ratio:.2f}  (aim: >= 0.90)")
    print(f"JSON-schema streams: {valid}/{total} ended and validated in {seconds:.1f} s")
    if args.json is not None:
        figures = {"base": base, "constrained": constrained, "ratio": ratio}
        figures |= {"schema_valid": valid, "schema_total": total}
        args.json.write_text(json.dumps(figures, indent=1))
    return 0 if valid == total else 1


if __name__ == "__main__":
    sys.exit(main())
