"""Draws the figures in docs/benchmarks.md from the measured results in docs/results/.

pip install matplotlib && python bench/plots.py
"""

from __future__ import annotations

import json
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


def main() -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    decode_bandwidth(json.loads((RESULTS / "kernels_final.json").read_text()))
    cpu_throughput()


if __name__ == "__main__":
    main()
