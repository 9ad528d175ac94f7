"""Incremental detokenization and stop strings, done outside the busy loop (vLLM's frontend)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from baton.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence
# A stream starts on the prompt's shortest tail of at least _SEED_MIN tokens that decodes
# cleanly, and gives up on a seed past _SEED_MAX (a prompt cut inside a character).
_SEED_MIN, _SEED_MAX = 4, 16
_CONTEXT = 4  # tokens of text already out that flush() decodes the held-back tokens after


class IncrementalDetokenizer:
    """Turns one sample's tokens into text as they come, and finds stop strings in it.

    A `tokenizers` DecodeStream decodes each new token with the few before it, because a token's
    text depends on its neighbours, and holds tokens back while they end in an unfinished
    character (a multi-byte character split over byte tokens comes out whole). The stream starts
    on the prompt's last tokens: a SentencePiece-style decoder strips the leading space of a
    text's first token, and the completion's first word would otherwise lose the space that
    separates it from the prompt (vLLM seeds its streams the same way). For byte-level
    tokenizers the seed changes nothing: the text equals `decode(token_ids)`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        prompt_token_ids: Sequence[int] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_reason: str | None = None
        self._seed = self._clean_tail(prompt_token_ids)
        self._stream = DecodeStream(ids=self._seed, skip_special_tokens=skip_special_tokens)
        self._held = 0  # token_ids[_held:_fed] are in the stream but not yet in the text
        self._fed = 0  # token_ids[:_fed] went through the stream (a stop token may not)

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Appends tokens; returns the stop string that ended the text, if one did.

        When a stop string is found the text is cut just before it, or just after it with
        `include_stop_str_in_output`. `stop_terminated`: the last token is the EOS or stop token
        that ended the request; as in vLLM (vllm/v1/engine/detokenizer.py) its text is left out
        unless `include_stop_str_in_output`, though the token stays in `token_ids`.
        """
        skipped = None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            *new_token_ids, skipped = new_token_ids
        try:
            return self._update(new_token_ids)
        finally:
            if skipped is not None:
                self.token_ids.append(skipped)

    def resume(self, token_ids: list[int]) -> None:
        """Takes the tokens another engine produced before this one resumed the answer, before
        any other: the text, and the bytes of an unfinished character held back, are as if
        they had come through `update`. Stop strings are not looked for in them (that engine
        did, and the answer went on); one that ends in the new text is found, where it starts
        in these tokens or not."""
        self._update(token_ids, find_stops=False)

    def _update(self, new_token_ids: list[int], find_stops: bool = True) -> str | None:
        for token in new_token_ids:
            self.token_ids.append(token)
            self._fed = len(self.token_ids)
            piece = self._step(token)
            if piece is None:
                continue  # wait for the rest of the character
            old_len = len(self.text)
            self.text += piece
            self._held = len(self.token_ids)
            if find_stops and self.stop and len(self.token_ids) >= self.min_tokens:
                stop = self._find_stop(old_len)
                if stop is not None:
                    return stop
        return None

    def flush(self) -> None:
        """At the end: whatever is still held back (an unfinished character) becomes text."""
        if self.stop_reason is None and self._held < self._fed:
            context = self._context()
            prefix = self._decode(context)
            full = self._decode(context + self.token_ids[self._held : self._fed])
            self.text += full[len(prefix) :]
            self._held = self._fed

    def _step(self, token: int) -> str | None:
        try:
            return self._stream.step(self.tokenizer.backend, token)
        except Exception as e:  # tokenizers raises a bare Exception
            if "invalid prefix" not in str(e).lower():
                raise
        # The window's text stopped starting with its own earlier text, which some vocabularies'
        # byte tokens provoke: the stream cannot go on, so a new one starts after the text
        # already out and takes the held-back tokens in one step.
        logger.warning("detokenizer: restarting a decode stream after an invalid prefix")
        self._stream = DecodeStream(
            ids=self._context(), skip_special_tokens=self.skip_special_tokens
        )
        return self._stream.step(self.tokenizer.backend, self.token_ids[self._held :])

    def _context(self) -> list[int]:
        """The last few tokens whose text is out (the seed's, before the first)."""
        start = self._held - _CONTEXT
        if start >= 0:
            return self.token_ids[start : self._held]
        return self._seed[max(0, len(self._seed) + start) :] + self.token_ids[: self._held]

    def _clean_tail(self, prompt_token_ids: Sequence[int]) -> list[int]:
        num_prompt = len(prompt_token_ids)
        longest = min(num_prompt, _SEED_MAX)
        for n in range(min(_SEED_MIN, longest), longest + 1):
            tail = list(prompt_token_ids[num_prompt - n :])
            if _REPLACEMENT not in self._decode(tail):
                return tail
        return []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        end = best[0] + len(best[1]) if self.include_stop_str_in_output else best[0]
        self.text = self.text[:end]
        self.stop_reason = best[1]
        return best[1]
