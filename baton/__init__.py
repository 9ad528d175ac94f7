"""Baton: LLM serving with disaggregated prefill and decode.

The public names load lazily, so `import baton` stays cheap for the router and the operator,
which never need torch.
"""

from __future__ import annotations

from typing import Any

from baton.version import __version__

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from baton.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from baton.engine.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from baton.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'baton' has no attribute {name!r}")
