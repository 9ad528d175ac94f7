"""Draws the figures in docs/benchmarks.md from the measured results in docs/results/.

pip install matplotlib && python bench/plots.py
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
IMAGES = ROOT / "docs" / "img"


def decode_bandwidth(kernels: dict) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    rows = [r for r in kernels["decode"] if r["dtype"] == "float16"]
    for batch in sorted({r["batch"] for r in rows}):
        points = sorted((r["context"], r["fraction_of_peak"]) for r in rows if r["batch"] == batch)
        ax.plot(
            [c for c, _ in points], [f * 100 for _, f in points], marker="o", label=f"batch {batch}"
        )
    ax.axhline(70, color="grey", linestyle="--", linewidth=1, label="aim: 70%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("% of HBM peak (4800 GB/s)")
    ax.set_title(f"Decode paged attention, fp16, {kernels['device']}")
    ax.set_ylim(0, 100)
    ax.legend()
    fig.tight_layout()
    fig.savefig(IMAGES / "decode_bandwidth.png", dpi=120)


def cpu_throughput() -> None:
    import matplotlib.pyplot as plt

    # Baton / vLLM, each pair measured in one run (docs/benchmarks.md, "Offline throughput
    # against vLLM, both models and both dtypes").
    labels = ["small\nfloat32", "small\nbfloat16", "SmolLM2\nfloat32", "SmolLM2\nbfloat16"]
    ratios = [2283 / 1930, 2862 / 2568, 93.6 / 106.6, 191.2 / 179.6]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    bars = ax.bar(labels, ratios, color="#4c72b0")
    ax.bar_label(bars, fmt="%.2fx")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.axhline(1.5, color="grey", linestyle="--", linewidth=1, label="aim: 1.5x")
    ax.set_ylabel("Baton / vLLM CPU, output tok/s")
    ax.set_title("offline throughput, same run each pair, 64 requests, 2 CPU cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(IMAGES / "cpu_throughput.png", dpi=120)


def _rate_and_ratio(
    results: dict,
    x: Callable[[dict], float],
    ours: tuple[str, str],
    theirs: tuple[str, str],
    labels: dict[str, str],
    aim: tuple[float, str],
    out: str,
) -> None:
    """Two panels from several runs' rows: our rate and the baseline's against `x` (log 2),
    and their ratio with its aim. `ours` and `theirs`: (row key, legend name)."""
    import matplotlib.pyplot as plt

    fig, (rate, ratio) = plt.subplots(1, 2, figsize=(9.6, 3.6))
    for i, run in enumerate(results["runs"]):
        xs = [x(r) for r in run]
        alpha, tag = 1 - 0.3 * i, f" (run {i + 1})"
        for (key, name), style, color in ((ours, "o-", "#4c72b0"), (theirs, "s--", "#dd8452")):
            rate.plot(xs, [r[key] for r in run], style, color=color, alpha=alpha, label=name + tag)
        ratios = [r[ours[0]] / r[theirs[0]] for r in run]
        ratio.plot(xs, ratios, "o-", color="#4c72b0", alpha=alpha, label=f"run {i + 1}")
    for ax in (rate, ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(labels["x"])
    rate.set_ylabel(labels["rate"])
    rate.set_title(labels["rate_title"])
    ratio.axhline(aim[0], color="grey", linestyle="--", linewidth=1, label=aim[1])
    ratio.set_ylim(0, None)
    ratio.set_ylabel(f"{ours[1]} / {theirs[1]}")
    ratio.set_title(labels["ratio_title"])
    for ax in (rate, ratio):
        ax.legend(fontsize=7)
    fig.suptitle(results["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(IMAGES / out, dpi=120)


def serve_concurrency(results: dict) -> None:
    """The server's output tok/s and the offline engine's on the same requests, run at most
    as many at a time, against the client's concurrency; and their ratio."""
    _rate_and_ratio(
        results,
        lambda r: r["concurrency"],
        ("server_tok_s", "server"),
        ("offline_tok_s", "offline"),
        {
            "x": "concurrent streams (--max-concurrency)",
            "rate": "output tok/s",
            "rate_title": "throughput against concurrency",
            "ratio_title": "the server's share of the offline rate",
        },
        (0.9, "aim at 64: 0.9x"),
        "serve_concurrency.png",
    )


def kv_transfer_sizes(results: dict) -> None:
    """TCP and raw-socket GB/s against the transfer's size (warm connection), and their ratio."""
    _rate_and_ratio(
        results,
        lambda r: r["bytes"] / 2**20,
        ("tcp_gbps", "TCP"),
        ("raw_socket_gbps", "raw socket"),
        {
            "x": "transfer size (MiB)",
            "rate": "GB/s",
            "rate_title": "KV transfer rate against size",
            "ratio_title": "the transport's share of the raw socket",
        },
        (0.8, "aim from 1 MiB: 0.8x"),
        "kv_transfer_sizes.png",
    )


def main() -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    decode_bandwidth(json.loads((RESULTS / "kernels_final.json").read_text()))
    cpu_throughput()
    serve_concurrency(json.loads((RESULTS / "serve_concurrency.json").read_text()))
    kv_transfer_sizes(json.loads((RESULTS / "kv_transfer_sizes.json").read_text()))


if __name__ == "__main__":
    main()
