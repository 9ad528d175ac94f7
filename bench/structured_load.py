"""Constrained streams under load: what grammars cost the requests that use none.

One `baton engine` of the `small` benchmark model, 128 concurrent streamed completions per round:
64 "free" ones (the measured group: fixed length, `ignore_eos`) and 64 "other" ones. In a
constrained round the others answer under a JSON schema (a list of 4-6 records: a few hundred
tokens each); every answer must end and validate (`jsonschema`), and nothing may hang. In a
baseline round the others are free too, each asked for exactly as many tokens as its constrained
twin produced (seeded, so the constrained answers repeat exactly from round to round): both rounds
run the same batch over time, and the only difference is the grammar's work (compiling, the
per-step bitmask, advancing the matcher, the check at the API edge). Rounds alternate so that a
machine busy elsewhere slows both alike. Prints the free group's output tok/s per round and the
ratio constrained / baseline (the aim: above 0.9).

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
from baton.ports import free_port

PERSON = {
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
SCHEMA = {"type": "array", "items": PERSON, "minItems": 4, "maxItems": 6}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}


class Engine:
    def __init__(self, model: Path, log: Path) -> None:
        self.port = free_port()
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


async def run_round(
    url: str, prompts: list[str], max_tokens: int, others: list[dict[str, Any]]
) -> tuple[float, list[tuple[str, int, str | None]]]:
    """The free group's output tok/s while `others` (one body per other stream) run beside it,
    and the others' (text, tokens, finish reason)."""
    half = len(prompts) // 2
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        free_done: list[float] = []

        async def free(p: str) -> int:
            _, n, _ = await _stream(client, _body(p, max_tokens, ignore_eos=True))
            free_done.append(time.perf_counter())
            return n

        results = await asyncio.gather(
            asyncio.gather(*(free(p) for p in prompts[:half])),
            asyncio.gather(*(_stream(client, body) for body in others)),
        )
    free_tokens, other_results = results
    return sum(free_tokens) / (max(free_done) - start), list(other_results)


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
            others = prompts[len(prompts) // 2 :]
            constrained_bodies = [
                _body(p, 8 * args.max_tokens, seed=i, response_format=RESPONSE_FORMAT)
                for i, p in enumerate(others)
            ]
            asyncio.run(run_round(engine.url, prompts[:8], 8, constrained_bodies[:4]))  # warm-up
            base: list[float] = []
            constrained: list[float] = []
            lengths: list[int] | None = None
            for _ in range(args.rounds):
                rate, answers = asyncio.run(
                    run_round(engine.url, prompts, args.max_tokens, constrained_bodies)
                )
                constrained.append(rate)
                for text, _, finish in answers:
                    assert finish == "stop", (finish, text)
                    jsonschema.validate(json.loads(text), SCHEMA)
                now = [n for _, n, _ in answers]
                assert lengths is None or now == lengths, "seeded answers changed between rounds"
                lengths = now
                twins = [
                    _body(p, n, seed=i, ignore_eos=True)
                    for i, (p, n) in enumerate(zip(others, lengths, strict=True))
                ]
                rate, _ = asyncio.run(run_round(engine.url, prompts, args.max_tokens, twins))
                base.append(rate)
        finally:
            engine.stop()
    assert lengths is not None
    print(f"free group: {args.streams} streams x {args.max_tokens} tokens, beside {args.streams} "
          f"others answering a JSON schema ({min(lengths)}-{max(lengths)} tokens, all valid) or "
          "their free twins of the same lengths (same run, rounds alternated)")  # fmt: skip
    print(f"{'round':>6} {'twins free tok/s':>17} {'others constrained tok/s':>25} {'ratio':>6}")
    for i, (b, c) in enumerate(zip(base, constrained, strict=True)):
        print(f"{i:>6} {b:>17.1f} {c:>25.1f} {c / b:>6.2f}")
    ratio = sum(constrained) / sum(base)
    print(f"mean ratio (constrained / free): {ratio:.2f}  (aim: >= 0.90)")
    if args.json is not None:
        figures = {"base": base, "constrained": constrained, "ratio": ratio, "lengths": lengths}
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
