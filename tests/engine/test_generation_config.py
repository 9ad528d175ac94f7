"""The model's recommended sampling defaults (`generation_config.json`), read as vLLM's
`--generation-config` reads them, and the flags that choose them."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from baton.engine.api.cli import add_server_args, configs_from_args
from baton.engine.generation_config import sampling_defaults


def _folder(tmp_path: Path, name: str, config: dict[str, object]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_the_sampling_fields_of_the_model_folders_file(tmp_path: Path) -> None:
    """`auto` takes vLLM's sampling fields from the model's file (`max_new_tokens` as
    `max_tokens`), leaving the rest (eos ids, do_sample) out; `vllm` none; a folder its own;
    the override on top of each."""
    model = _folder(
        tmp_path,
        "model",
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
         "repetition_penalty": 1.05, "max_new_tokens": 64, "min_p": None},
    )  # fmt: skip
    assert sampling_defaults(model) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 64,
    }
    assert sampling_defaults(model, "vllm") == {}
    assert sampling_defaults(model, "vllm", {"temperature": 0.2}) == {"temperature": 0.2}
    other = _folder(tmp_path, "other", {"presence_penalty": 0.5})
    assert sampling_defaults(model, str(other)) == {"presence_penalty": 0.5}
    override = {"temperature": 0.0, "max_new_tokens": 3}
    assert sampling_defaults(model, "auto", override)["temperature"] == 0.0
    assert sampling_defaults(model, "auto", override)["max_tokens"] == 3
    assert sampling_defaults(tmp_path) == {}  # no file: vLLM's defaults
    with pytest.raises(ValueError, match="not 'auto', 'vllm' or a folder"):
        sampling_defaults(model, str(tmp_path / "missing"))


def test_the_flags(tmp_path: Path) -> None:
    """--generation-config and --override-generation-config (JSON) reach the server's config;
    JSON that is not an object stops the parse."""
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(
        ["--generation-config", "vllm", "--override-generation-config", '{"top_k": 5}']
    )
    _, server = configs_from_args(args)
    assert server.generation_config == "vllm"
    assert server.override_generation_config == {"top_k": 5}
    with pytest.raises(SystemExit):
        parser.parse_args(["--override-generation-config", "[1]"])
    with pytest.raises(ValueError, match="not 'auto', 'vllm' or a folder"):
        configs_from_args(parser.parse_args(["--generation-config", str(tmp_path / "x")]))


def test_the_offline_engine_samples_with_them_when_given_no_params(
    tiny_model, tmp_path: Path
) -> None:
    """`LLM.generate` without params uses `get_default_sampling_params`, as vLLM's does: here
    the model's greedy temperature and its max_new_tokens."""
    from baton import LLM, SamplingParams

    model = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=4)
    (model / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(model), max_model_len=128)
    defaults = llm.get_default_sampling_params()
    assert defaults.greedy and defaults.max_tokens == 4
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    alone = llm.generate(prompt)[0].outputs[0].token_ids
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(alone) <= 4 and list(alone) == list(greedy[0].outputs[0].token_ids)[: len(alone)]
    plain = LLM(str(model), max_model_len=128, generation_config="vllm")
    assert not plain.get_default_sampling_params().greedy
