"""Reasoning parsers (vLLM's `--reasoning-parser`): split a chat answer into the model's
`<think>...</think>` reasoning and the content after it.

A parser is pure text in, text out, and works on a growing prefix: `split(text, final=False)`
returns only what no continuation of `text` can change (a possible start of `</think>` at the
end stays held back), so a stream that sends the growth of each split sends, in the end,
exactly what `split(text, final=True)` returns for the whole answer.

Where the answer starts depends on the prompt: a template may already have opened the
thinking (`<think>\\n` at the end of the generation prompt, as DeepSeek-R1's and Qwen3's
thinking-only templates do) or closed it (`<think>\\n\\n</think>` for Qwen3 with
enable_thinking false); `state_after(prompt)` reads that off the rendered prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# open: the answer starts inside the reasoning; closed: it has none; auto: the model decides.
ThinkState = Literal["open", "closed", "auto"]


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (less than all)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the answer has no reasoning part
    content: str
    ended: bool  # the reasoning is over (or there is none): what follows is content


class ReasoningParser:
    """`<think>...</think>` reasoning; subclasses say what an answer without tags means."""

    name = ""
    start = "<think>"
    end = "</think>"

    def state_after(self, prompt: str) -> ThinkState:
        """Whether the rendered prompt left the answer inside, after or before the reasoning."""
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return "closed"
        if tail.endswith(self.start):
            return "open"
        return "auto"

    def split(self, text: str, state: ThinkState, final: bool) -> Split:
        if state == "closed":
            return Split(None, text, True)
        if state == "auto":
            undecided = self._undecided(text, final)
            if undecided is not None:
                return undecided
        if text.startswith(self.start):
            text = text[len(self.start) :]
        elif not final and self.start.startswith(text):
            return Split("", "", False)  # may still be the opening tag
        i = text.find(self.end)
        if i >= 0:
            return Split(text[:i], text[i + len(self.end) :], True)
        if final:
            return Split(text, "", False)
        return Split(text[: len(text) - partial_suffix(text, self.end)], "", False)

    def _undecided(self, text: str, final: bool) -> Split | None:
        """What an answer the model may or may not open with `<think>` means; None: treat it
        as reasoning until `</think>`."""
        return None


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (vLLM's `deepseek_r1`): its template opens the thinking, so everything up to
    `</think>` is reasoning, all of an answer without it too."""

    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (vLLM's `qwen3`): reasoning only when the answer opens with `<think>` (or the
    prompt opened it); an answer that does not is all content."""

    name = "qwen3"

    def _undecided(self, text: str, final: bool) -> Split | None:
        if text.startswith(self.start):
            return None
        if not final and self.start.startswith(text):
            return Split(None, "", False)  # may still be the opening tag
        return Split(None, text, True)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; expected one of {sorted(REASONING_PARSERS)}"
        ) from None
