"""Baton's on-disk cache: where it lives, and folders written once and published whole.

`$BATON_CACHE_DIR`, else `~/.cache/baton`, holds the built-in tiny model, GGUF files' prepared
folders and the compiled CPU attention kernel (the operator points it at an emptyDir).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """The root of Baton's cache: `$BATON_CACHE_DIR`, else `~/.cache/baton`."""
    env = os.environ.get("BATON_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "baton"


def write_once(final: Path, write: Callable[[Path], object]) -> Path:
    """`final`, a folder `write` fills on first use: written beside it and renamed in, so that a
    reader never sees it partial; where another process renames first, its copy is kept."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
