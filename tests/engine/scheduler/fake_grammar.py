"""A fake `StructuredOutputManager` (same signature as baton/engine/structured/manager.py) for
driving the scheduler's structured-output path without a grammar library.

Its "grammar" is `StructuredOutputsParams(regex="7 8 9")`: exactly those token ids, then EOS.
`regex="!message"` fails to compile with that message. Compiles finish when the test says so
(`compile_all`), or at once with `instant=True`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from baton.engine.sampling_params import StructuredOutputsParams
from baton.engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from baton.engine.scheduler.scheduler import Scheduler

VOCAB = 64


@dataclass
class _Matcher:
    sequence: list[int]
    after: tuple[int, ...] | None
    seen: list[int] = field(default_factory=list)  # every accepted token
    pos: int = 0  # tokens of `sequence` matched
    active: bool = True

    @property
    def terminated(self) -> bool:
        return self.active and self.pos == len(self.sequence)


class FakeGrammarManager:
    def __init__(self, eos: int, instant: bool = False) -> None:
        self.eos = eos
        self.instant = instant
        self.matchers: dict[str, _Matcher] = {}
        self.errors: dict[str, str] = {}
        self.compiling: set[str] = set()
        self.accepted: dict[str, list[int]] = {}  # kept after remove, for the tests
        self.removed: list[str] = []

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        assert params.regex is not None
        if params.regex.startswith("!"):
            self.errors[request_id] = params.regex[1:]
        else:
            after = params.after_token_ids
            self.matchers[request_id] = _Matcher(
                [int(t) for t in params.regex.split()], after, active=after is None
            )
        self.accepted[request_id] = []
        if not self.instant:
            self.compiling.add(request_id)

    def compile_all(self) -> None:
        self.compiling.clear()

    def is_ready(self, request_id: str) -> bool:
        return request_id not in self.compiling

    def error(self, request_id: str) -> str | None:
        return self.errors.get(request_id)

    def allowed(self, request_id: str) -> list[int]:
        m = self.matchers[request_id]
        if not m.active:
            return list(range(VOCAB))
        return [self.eos] if m.terminated else [m.sequence[m.pos]]

    def bitmask(self, request_ids: Sequence[str]) -> np.ndarray | None:
        mask = np.zeros((len(request_ids), (VOCAB + 31) // 32), dtype=np.int32)
        any_active = False
        for i, rid in enumerate(request_ids):
            assert self.is_ready(rid) and rid not in self.errors
            any_active |= self.matchers[rid].active
            bits = np.zeros(mask.shape[1] * 32, dtype=bool)
            bits[self.allowed(rid)] = True
            mask[i] = np.packbits(bits, bitorder="little").view(np.int32)
        return mask if any_active else None

    def accept(self, request_id: str, token_id: int) -> bool:
        m = self.matchers[request_id]
        self.accepted[request_id].append(token_id)
        if not m.active:
            m.seen.append(token_id)
            if m.after and tuple(m.seen[-len(m.after) :]) == m.after:
                m.active = True
            return True
        if token_id not in self.allowed(request_id):
            return False
        if not m.terminated:
            m.pos += 1
        return True

    def is_terminated(self, request_id: str) -> bool:
        return self.matchers[request_id].terminated

    def remove(self, request_id: str) -> None:
        self.removed.append(request_id)
        self.matchers.pop(request_id, None)
        self.errors.pop(request_id, None)
        self.compiling.discard(request_id)


def allowed_tokens(row: np.ndarray) -> list[int]:
    """The token ids a bitmask row allows."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits)]


def masked_runner_output(
    sched: Scheduler, out: SchedulerOutput, free_token: int, sampling: list[str]
) -> ModelRunnerOutput:
    """A fake model that samples the lowest token a constrained row allows, `free_token` for
    unconstrained rows and rows that allow everything."""
    rows = {rid: i for i, rid in enumerate(out.structured_output_request_ids)}
    sampled = {}
    for rid in sampling:
        if rid in rows:
            assert out.grammar_bitmask is not None
            allowed = allowed_tokens(out.grammar_bitmask[rows[rid]])
            sampled[rid] = free_token if len(allowed) == VOCAB else allowed[0]
        else:
            sampled[rid] = free_token
    return ModelRunnerOutput(sampled)
