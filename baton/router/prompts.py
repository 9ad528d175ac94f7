"""What the router reads from a generation request's prompt: its text or token ids, its length
in tokens (exact, or estimated), and its block hashes: exact ones, and approximate ones.

Exact: when the router has the model's tokenizer (`tokenizers`), `tokens` holds the ids the
engine will compute, and `exact_hashes` chains them into the engine's own block hashes
(`baton.block_hash`, with the request's `cache_salt`), as its KV events name them.

Approximate, for engines that publish no events: a "block" is a run of `block_chars`
characters, or of `TOKEN_BLOCK` ids for a prompt given as token ids, and each block's hash
chains its parent's. Two prompts that share their first k blocks here share about
k * block_chars characters, so they share most of the engine blocks covering them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton.block_hash import block_hashes, external_hash

TOKEN_BLOCK = 16  # ids per block of a prompt given as token ids (the engines' block size)


@dataclass
class Prompt:
    """One request's prompt, as far as routing needs it."""

    text: str | None = None  # the prompt (or the rendered chat) as text, when it is text
    token_ids: list[int] | None = None  # the prompt as token ids, when it came as ids
    num_prompts: int = 1  # a completions batch has several; routing reads the first
    num_messages: int = 0  # chat messages (each adds a few template tokens)
    tokens: list[int] | None = None  # the ids the engine will compute, when the router knows
    cache_salt: str | None = None  # the request's, as the engine gets it
    _hashes: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _exact: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def estimated_tokens(self, chars_per_token: float) -> int:
        """Exact for token ids; characters / `chars_per_token` (+ 4 per chat message) for text."""
        if self.tokens is not None:
            return len(self.tokens)
        if self.token_ids is not None:
            return len(self.token_ids)
        return int(len(self.text or "") / chars_per_token) + 4 * self.num_messages

    def exact_hashes(self, block_size: int) -> list[int]:
        """The engine's hashes of the prompt's full blocks (as KV events carry them); empty
        without `tokens`."""
        hashes = self._exact.get(block_size)
        if hashes is None:
            chain = block_hashes(self.tokens or (), block_size, self.cache_salt)
            hashes = self._exact[block_size] = [external_hash(h) for h in chain]
        return hashes

    def block_hashes(self, block_chars: int) -> list[int]:
        """Chained hashes of the prompt's full blocks, first block first (cached per size)."""
        hashes = self._hashes.get(block_chars)
        if hashes is None:
            hashes = self._compute(block_chars)
            self._hashes[block_chars] = hashes
        return hashes

    def _compute(self, block_chars: int) -> list[int]:
        prompt: tuple[int, ...] | str = self.text or ""
        size = block_chars
        if self.token_ids is not None:
            prompt, size = tuple(self.token_ids), TOKEN_BLOCK
        hashes: list[int] = []
        parent = 0
        for start in range(0, len(prompt) - size + 1, size):
            parent = hash((parent, prompt[start : start + size]))
            hashes.append(parent)
        return hashes


def _chat_text(messages: Any) -> tuple[str, int]:
    """The messages as one string in template order (role, then content), and their count."""
    if not isinstance(messages, list):
        return "", 0
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        parts.append(f"<{message.get('role', '')}>")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "".join(parts), len(messages)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int) for x in value)


def prompt_of(body: dict[str, Any]) -> Prompt:
    """The prompt of a completions (`prompt`) or chat completions (`messages`) request body.

    Malformed prompts give an empty `Prompt`: the engine, not the router, answers the 400.
    """
    if "messages" in body:
        text, count = _chat_text(body["messages"])
        return Prompt(text=text, num_messages=count)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return Prompt(text=prompt)
    if isinstance(prompt, list) and _is_ids(prompt):
        return Prompt(token_ids=list(prompt))
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return Prompt(text=first, num_prompts=len(prompt))
        if _is_ids(first):
            return Prompt(token_ids=list(first), num_prompts=len(prompt))
    return Prompt()
