"""Loads a model folder's tokenizer and renders chat prompts through its template."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path) -> Any:
    """A `transformers` fast tokenizer from `tokenizer.json` (+ `tokenizer_config.json`)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no tokenizer.json")
    from transformers import AutoTokenizer  # heavy import: only when a tokenizer is needed

    return AutoTokenizer.from_pretrained(str(path))


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m for m in messages
    ):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
