"""Incremental detokenization and stop strings, done outside the busy loop (vLLM's frontend)."""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns tokens into text a few at a time, and finds stop strings in it.

    Each new token is decoded together with a few tokens before it (`prefix_offset`), because a
    token's text can depend on its neighbours (leading spaces, multi-byte characters split across
    tokens); only the part past the previous read point is new text.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str],
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends tokens; returns the stop string that ended the text, if one did.

        When a stop string is found the text is cut just before it (it is not returned).
        """
        for token in new_token_ids:
            self.token_ids.append(token)
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset :])
            if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
                continue  # wait for the rest of the character
            old_len = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            if self.stop and len(self.token_ids) >= self.min_tokens:
                stop = self._find_stop(old_len)
                if stop is not None:
                    return stop
        return None

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.stop_reason = best[1]
        return best[1]

    def flush(self) -> None:
        """At the end: whatever is still held back (an unfinished character) becomes text."""
        if self.stop_reason is None and self.read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset :])
            self.text += full[len(prefix) :]
            self.read_offset = len(self.token_ids)
