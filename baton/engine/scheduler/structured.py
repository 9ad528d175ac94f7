"""What the scheduler needs from the grammar side of structured outputs.

The EngineCore owns the real `StructuredOutputManager` (baton/engine/structured/manager.py);
the scheduler only sees this protocol, so that it imports nothing of the grammar backend and
its tests can drive it with a fake.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from baton.engine.sampling_params import StructuredOutputsParams


class GrammarManager(Protocol):
    """Per-request grammar matchers, keyed by request id (see the manager for the details)."""

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None: ...

    def is_ready(self, request_id: str) -> bool: ...

    def error(self, request_id: str) -> str | None: ...

    def bitmask(self, request_ids: Sequence[str]) -> np.ndarray | None: ...

    def accept(self, request_id: str, token_id: int) -> bool: ...

    def is_terminated(self, request_id: str) -> bool: ...

    def remove(self, request_id: str) -> None: ...
