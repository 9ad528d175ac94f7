"""The sampling defaults a model recommends (its `generation_config.json`), as vLLM's
`--generation-config` reads them.

A request that leaves a sampling field out gets the model's value where its generation config
has one, else vLLM's neutral default (temperature 1, top_p 1, ...). `auto` (the default) reads
the model folder's file, a folder reads that folder's, `vllm` reads none; the
`--override-generation-config` JSON goes on top in every case. The file's `max_new_tokens` is
the default `max_tokens` of a chat answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# What vLLM takes from a generation config (`ModelConfig.get_diff_sampling_param`).
SAMPLING_KEYS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def sampling_defaults(
    model_path: Path, source: str = "auto", override: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The sampling fields the model's generation config sets (`max_new_tokens` as
    `max_tokens`); a ValueError names a source that is no folder or a file that is no JSON
    object."""
    check_source(source)
    if source == "vllm":
        config: dict[str, Any] = {}
    else:
        folder = Path(model_path) if source == "auto" else Path(source)
        config = _read(folder / "generation_config.json")
    config.update(override or {})
    found = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    return found


def check_source(source: str) -> None:
    """A ValueError unless `source` is `auto`, `vllm` or a folder."""
    if source not in ("auto", "vllm") and not Path(source).is_dir():
        raise ValueError(f"--generation-config {source!r} is not 'auto', 'vllm' or a folder")


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data
