"""Hand-off overhead of disaggregated serving: what the decode engine adds on top of moving bytes.

Starts a prefill and a decode `baton engine` (the built-in ``small`` model, TCP transport, one
torch thread each, as `bench/disagg.py` runs them) as real processes, then for each of
``--repeats`` fresh 2,001-token prompts: the prefill step (max_tokens 1, ``do_remote_decode``),
then the decode request with the prefill's ``kv_transfer_params``, streamed, timed from sending it
to its first content chunk (the decode side's time to first token: the pull, the recompute of the
last prompt token, sampling, HTTP). Beside it, in the same run:

- the raw transfer: the same number of KV bytes sent once over a loopback socket between two
  processes (``sendall`` into ``recv_into``), a sample after each pair below (the median);
- the transport's own time for the pull (``baton:kv_transfer_seconds`` on the decode engine);
- for scale, the prefill engine's time for the whole prefill.

overhead = decode TTFT, server side (the engine's own ``vllm:time_to_first_token_seconds``, from the
request's arrival) - raw transfer. The client-side figure and a no-pull floor (a prompt the decode
engine already caches, client and server side) are printed beside it. The hand-off's own cost
(issue 23's aim: at most the raw transfer time) is the median over pairs of the server-side first
token with the pull minus the one without, each pair a hand-off and then a floor request, so that
the machine's drift cancels. Both sides of a pair must compute the same prompt tokens: the prefix
cache matches whole blocks and leaves at least one token to compute, and the pull brings all but
the last token, so a prompt one token past a whole number of blocks (2,001 = 125 x 16 + 1) has
each compute exactly one. The engine's own count (``vllm:prompt_tokens_by_source`` with
``local_compute``) is read around each timed request, and a warning printed where the two sides
differ (not with ``--busy``, whose streams' prompts count there too). Aim (issue 4): overhead
below the raw transfer time.

With ``--busy N``, N streams decode on the decode engine the whole time (both for the hand-offs
and for the no-pull floor): the hand-off then joins a running batch, whose steps its pull can
overlap, as in a serving decode engine.

With ``--tensor-parallel-size 2`` both engines run two ranks: each decode rank pulls its half of
the KV heads from the matching prefill rank, on connections of its own (issue 9).

    python bench/handoff.py [--repeats 10] [--prompt-len 2001] [--tensor-parallel-size N]
                            [--warm-cache] [--busy N] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baton.engine.models.config import ModelConfig  # noqa: E402
from baton.engine.models.tiny import default_model_path  # noqa: E402
from baton.ports import free_port  # noqa: E402


def _start(
    model: Path, role: str, max_len: int, tp: int, num_blocks: int | None
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "engine",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--role", role,
        "--max-model-len", str(max_len), "--served-model-name", "small",
        "--disable-uvicorn-access-log", "--tensor-parallel-size", str(tp),
    ]  # fmt: skip
    if num_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(num_blocks)]
    # One torch thread per engine: two engines' OpenMP teams on shared cores wait on each other's
    # preempted threads, which moved a one-token step between 4 and 27 ms in a run of this script.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"engine at {url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"engine at {url} not ready after {timeout} s")


def _metric(url: str, name: str, label: str = "") -> float:
    """The first sample of `name` (with `label`, e.g. 'source="x"', among its labels)."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise SystemExit(f"{url}/metrics has no {name} {label}")


_TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
_COMPUTED = ("vllm:prompt_tokens_by_source_total", 'source="local_compute"')


def _timed(url: str, prompt: list[int], params: dict[str, Any]) -> tuple[float, float, float]:
    """One decode request: (client-side first token, server-side first token, prompt tokens the
    engine computed), the server's figures read from its metrics around the request."""
    ttft0, computed0 = _metric(url, _TTFT_SUM), _metric(url, *_COMPUTED)
    client = _decode_ttft(url, prompt, params)
    return client, _metric(url, _TTFT_SUM) - ttft0, _metric(url, *_COMPUTED) - computed0


def _sender(port: int, nbytes: int) -> None:
    payload = bytearray(nbytes)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while s.recv(1):  # "go"; b"" when the reader is done
            s.sendall(payload)


class RawTransfer:
    """The floor of moving the bytes: one loopback send of `nbytes` from another process, timed
    from the first byte asked to the last byte received. A sample is taken beside each hand-off
    pair, so that the ratio compares times from the same moments of the run."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        listener = socket.create_server(("127.0.0.1", 0))
        self.child = mp.get_context("spawn").Process(
            target=_sender, args=(listener.getsockname()[1], nbytes)
        )
        self.child.start()
        self.conn, _ = listener.accept()
        listener.close()
        self.buf = memoryview(bytearray(nbytes))
        self.sample()  # the buffer's first touch is not the transfer's

    def sample(self) -> float:
        start = time.perf_counter()
        self.conn.sendall(b"g")
        got = 0
        while got < self.nbytes:
            got += self.conn.recv_into(self.buf[got:], 0, socket.MSG_WAITALL)
        return time.perf_counter() - start

    def close(self) -> None:
        self.conn.close()
        self.child.join(30)


@functools.cache
def _client() -> httpx.Client:
    """One client for the timed requests: a new `httpx.Client` (what `httpx.post` makes for each
    call) builds an SSL context first, about 25 ms that a client-side first token then counted."""
    return httpx.Client(timeout=120)


def _complete(url: str, prompt: list[int], **extra: Any) -> httpx.Response:
    body = {"model": "small", "prompt": prompt, "temperature": 0.0, "ignore_eos": True, **extra}
    return _client().post(f"{url}/v1/completions", json=body)


def _decode_ttft(url: str, prompt: list[int], params: dict[str, Any]) -> float:
    body = {
        "model": "small", "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "kv_transfer_params": params,
    }  # fmt: skip
    start = time.perf_counter()
    with _client().stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("no token came back")


def _keep_busy(url: str, num_streams: int, stop: threading.Event, max_tokens: int) -> None:
    """Keeps `num_streams` greedy streams decoding on the engine at `url` until `stop`: the
    batch a hand-off joins (each stream starts again when it ends)."""

    def one(i: int) -> None:
        body = {
            "model": "small", "prompt": [5 + i, 6, 7, 8], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
        }  # fmt: skip
        while not stop.is_set():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(num_streams)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=2001,
        help="prompt tokens; one past a whole number of 16-token blocks makes the hand-off and "
        "the no-pull floor compute one token each",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--warm-cache",
        action="store_true",
        help="engines with a KV cache of four prompts, cycled through whole before timing: every "
        "pull lands in blocks used before, as in a long-running engine (a fresh engine's CPU "
        "cache is committed page by page as blocks are first written)",
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="N streams decoding on the decode engine throughout (started after the warm-up): "
        "each hand-off joins a running batch, and the pull can overlap its steps",
    )
    args = parser.parse_args()

    model = default_model_path()
    mc = ModelConfig.from_pretrained(model)
    max_len = args.prompt_len + 16
    # The pull moves the blocks that hold all but the last prompt token; the engines keep the
    # model's float32 on CPU: K and V of every layer, 4 bytes each.
    pulled_tokens = -(-(args.prompt_len - 1) // 16) * 16
    kv_bytes = pulled_tokens * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4
    per_prompt = -(-args.prompt_len // 16)  # blocks of 16 tokens
    num_blocks = 4 * per_prompt + 16 if args.warm_cache else None
    raw = RawTransfer(kv_bytes)
    (pre, pre_url), (dec, dec_url) = (
        _start(model, "prefill", max_len, args.tensor_parallel_size, num_blocks),
        _start(model, "decode", max_len, args.tensor_parallel_size, num_blocks),
    )
    try:
        _wait(pre_url, pre)
        _wait(dec_url, dec)
        rng = random.Random(0)
        vocab = mc.vocab_size

        def prompt() -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(args.prompt_len)]

        # Warm-up: first connections, first-use compilation; with --warm-cache, every block.
        for _ in range(6 if args.warm_cache else 2):
            p = prompt()
            params = _complete(
                pre_url, p, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
            ).json()["kv_transfer_params"]
            _decode_ttft(dec_url, p, params)
        stop_busy = threading.Event()
        busy = threading.Thread(
            target=_keep_busy, args=(dec_url, args.busy, stop_busy, 256), daemon=True
        )
        busy.start()
        if args.busy:
            time.sleep(1.0)  # the streams are running
        sum0 = _metric(dec_url, "baton:kv_transfer_seconds_sum")
        count0 = _metric(dec_url, "baton:kv_transfer_seconds_count")
        prefill_s: list[float] = []
        # Each pair: a hand-off, then the floor: the same decode engine answering a prompt it
        # already caches (no pull): HTTP, admission, one step computing the same prompt tokens.
        handoffs: list[tuple[float, float, float]] = []
        floors: list[tuple[float, float, float]] = []
        raw_samples: list[float] = []
        for _ in range(args.repeats):
            p = prompt()
            start = time.perf_counter()
            r = _complete(pre_url, p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            prefill_s.append(time.perf_counter() - start)
            handoffs.append(_timed(dec_url, p, r.json()["kv_transfer_params"]))
            p = prompt()
            _complete(dec_url, p, max_tokens=1)
            floors.append(_timed(dec_url, p, {}))
            raw_samples.append(raw.sample())
        stop_busy.set()
        busy.join(60)
        pulls = _metric(dec_url, "baton:kv_transfer_seconds_count") - count0
        transport_s = (_metric(dec_url, "baton:kv_transfer_seconds_sum") - sum0) / max(pulls, 1)
        failures = sum(
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{dec_url}/metrics").text.splitlines()
            if line.startswith("baton:kv_transfer_failures_total{")
        )
    finally:
        raw.close()
        for proc in (pre, dec):
            proc.terminate()
        for proc in (pre, dec):
            proc.wait(30)
    raw_s = statistics.median(raw_samples)
    ttft, server_ttft, computed_pull = (statistics.median(x) for x in zip(*handoffs, strict=True))
    floor, floor_server, computed_floor = (statistics.median(x) for x in zip(*floors, strict=True))
    cost = statistics.median(h[1] - f[1] for h, f in zip(handoffs, floors, strict=True))
    computed = {computed_pull, computed_floor}
    overhead = server_ttft - raw_s
    result = {
        "prompt_tokens": args.prompt_len,
        "tensor_parallel_size": args.tensor_parallel_size,
        "kv_bytes": kv_bytes,
        "repeats": args.repeats,
        "warm_cache": args.warm_cache,
        "busy_streams": args.busy,
        "prefill_seconds_median": statistics.median(prefill_s),
        "decode_ttft_median": ttft,
        "decode_server_ttft_median": server_ttft,
        "cached_prompt_ttft_median": floor,
        "cached_prompt_server_ttft_median": floor_server,
        "handoff_cost_seconds": cost,
        "handoff_cost_over_raw_transfer": cost / raw_s,
        "computed_prompt_tokens": None if args.busy else sorted(computed),
        "decode_ttft_p90": sorted(h[0] for h in handoffs)[int(0.9 * (len(handoffs) - 1))],
        "transport_pull_seconds_mean": transport_s,
        "raw_transfer_seconds_median": raw_s,
        "raw_transfer_seconds": raw_samples,
        "decode_server_ttft_seconds": [h[1] for h in handoffs],
        "cached_prompt_server_ttft_seconds": [f[1] for f in floors],
        "overhead_seconds": overhead,
        "overhead_over_raw_transfer": overhead / raw_s,
        "pull_failures": failures,
    }
    ms = 1e3
    mib = kv_bytes / 2**20
    tp, n = args.tensor_parallel_size, args.repeats
    print(
        f"prompt {args.prompt_len} tokens, {mib:.1f} MiB of KV, {n} hand-offs, tp={tp}, "
        f"{args.busy} streams decoding beside"
    )
    prefill_ms = result["prefill_seconds_median"] * ms
    print(f"  prefill engine, whole prefill (median)      {prefill_ms:8.2f} ms")
    print(f"  decode engine, arrival to first token       {ttft * ms:8.2f} ms (medians)")
    print(f"  same, server side (arrival to first token)  {server_ttft * ms:8.2f} ms")
    print(f"  cached prompt, no pull (client)             {floor * ms:8.2f} ms")
    print(f"  same, server side                           {floor_server * ms:8.2f} ms")
    print(f"  the hand-off's own cost (with - without)    {cost * ms:8.2f} ms "
          f"({cost / raw_s:.2f}x the raw transfer; aim <= 1x; median of {n} pairs)")  # fmt: skip
    if len(computed) > 1 and not args.busy:  # the busy streams' prompts count there too
        print(f"  WARNING: the two sides computed {sorted(computed)} prompt tokens: not like with "
              "like (see --prompt-len)")  # fmt: skip
    print(f"  transport's pull (decode metrics, mean)     {transport_s * ms:8.2f} ms")
    print(f"  raw loopback transfer of the same bytes     {raw_s * ms:8.2f} ms")
    print(f"  overhead = server first token - raw        {overhead * ms:8.2f} ms "
          f"({overhead / raw_s:.2f}x the raw transfer; aim < 1x)")  # fmt: skip
    if failures:
        print(f"  WARNING: {failures:.0f} pulls failed (recomputed)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
