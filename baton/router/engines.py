"""The engines the router knows: one `EngineState` per discovered endpoint (what it serves, its
health, its load), and `EngineSet`, which keeps them in step with discovery and answers "which
engines of this model and role can take a request now"."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from baton.roles import Role
from baton.router.discovery import Endpoint

# Who may answer which step: a decode step goes to decode engines or aggregated ones.
DECODE_ROLES: tuple[Role, ...] = ("decode", "both")
PREFILL_ROLES: tuple[Role, ...] = ("prefill",)
AGGREGATED_ROLES: tuple[Role, ...] = ("both",)


@dataclass(eq=False)
class EngineState:
    """One engine as the router sees it. Mutated only on the router's event loop."""

    endpoint: Endpoint
    # Served model names (`models`): the endpoint's when discovery knows it, else from GET
    # /v1/models.
    _models: tuple[str, ...] = ()
    cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # model id -> /v1/models card
    _healthy: bool = False  # `healthy`
    checked: bool = False  # an active check has finished at least once
    consecutive_failures: int = 0  # failed requests in a row (passive health)
    ejected_until: float | None = None  # monotonic time; None: not ejected
    in_flight: int = 0  # requests this router has open on the engine
    # least-load: running + waiting at the last scrape, and in_flight at that moment, so
    # requests sent or finished since then correct the stale figure
    scraped_load: float = 0.0
    in_flight_at_scrape: int = 0
    # From /health: KV blocks move only between engines that agree on what they mean: equal
    # tensor_parallel_size and equal compatibility fingerprint (one digest of model config,
    # weights, dtype, block size, KV layout, tokenizer and template, wire version). None: not
    # known (yet, or an engine of an older Baton that does not say).
    tensor_parallel_size: int | None = None
    fingerprint: str | None = None
    compatibility: dict[str, str | int | float | bool] = field(default_factory=dict)  # its parts
    # A warning said this (decode) engine has no compatible prefill engine; cleared when it has.
    warned_unpaired: bool = False
    # Called when the engine comes up (`healthy` turns true): requests held for its models
    # may go on. Set by `EngineSet`.
    on_up: Callable[[EngineState], None] | None = field(default=None, repr=False)
    # Called when `models` changes (`EngineSet` indexes the engines by model). Set by it.
    on_models: Callable[[], None] | None = field(default=None, repr=False)
    # The endpoint's, as plain attributes: read for every candidate of every request.
    url: str = field(init=False)
    role: Role = field(init=False)

    def __post_init__(self) -> None:
        self.url = self.endpoint.url
        self.role = self.endpoint.role
        if self.endpoint.model is not None and not self.models:
            self.models = (self.endpoint.model,)

    @property
    def models(self) -> tuple[str, ...]:
        return self._models

    @models.setter
    def models(self, models: tuple[str, ...]) -> None:
        self._models = models
        if self.on_models is not None:
            self.on_models()

    @property
    def healthy(self) -> bool:
        """The latest active check passed (its models are known then); set by the health
        checks, and cleared by a passive ejection until a check passes again."""
        return self._healthy

    @healthy.setter
    def healthy(self, ok: bool) -> None:
        came_up = ok and not self._healthy
        self._healthy = ok
        if came_up and self.on_up is not None:
            self.on_up(self)

    def available(self, now: float) -> bool:
        """Healthy by its last check, not ejected, and its models known."""
        ejected = self.ejected_until is not None and now < self.ejected_until
        return self.healthy and not ejected and bool(self.models)

    def can_pair_with(self, other: EngineState) -> bool:
        """Whether a KV hand-off between the two can work: equal tensor-parallel sizes and
        equal fingerprints, each where both engines say (an engine refuses a mismatch it sees
        with a 400; one that says nothing pairs as engines did before fingerprints)."""
        return _agree(self.tensor_parallel_size, other.tensor_parallel_size) and _agree(
            self.fingerprint, other.fingerprint
        )

    def load(self) -> float:
        """Requests on the engine: the scraped count, corrected by what changed since."""
        return max(0.0, self.scraped_load + self.in_flight - self.in_flight_at_scrape)


class EngineSet:
    """The known engines by URL, in step with discovery; `on_up` is called with each engine
    that comes up (its health check passes after failing, or for the first time)."""

    def __init__(self, on_up: Callable[[EngineState], None] | None = None) -> None:
        self._engines: dict[str, EngineState] = {}
        self._on_up = on_up
        # (model, roles) -> its engines, in discovery order: asked several times per request,
        # so kept, and made again only after the set or an engine's models change.
        self._of_model: dict[tuple[str, tuple[Role, ...]], tuple[EngineState, ...]] = {}
        self._by_model: dict[str, list[EngineState]] | None = None  # None: to be made again

    def __iter__(self) -> Iterator[EngineState]:
        return iter(list(self._engines.values()))

    def __len__(self) -> int:
        return len(self._engines)

    def update(
        self, endpoints: Collection[Endpoint]
    ) -> tuple[list[EngineState], list[EngineState]]:
        """Makes the set match `endpoints`; returns (added, removed). An endpoint whose role or
        model changed counts as removed and added."""
        wanted = {e.url: e for e in endpoints}
        removed = [s for url, s in self._engines.items() if wanted.get(url) != s.endpoint]
        for state in removed:
            del self._engines[state.url]
            state.on_models = None
        added = []
        for url, endpoint in wanted.items():
            if url not in self._engines:
                state = EngineState(endpoint, on_up=self._on_up, on_models=self._changed)
                self._engines[url] = state
                added.append(state)
        if added or removed:
            self._changed()
        return added, removed

    def _changed(self) -> None:
        self._of_model.clear()
        self._by_model = None

    def _index(self) -> dict[str, list[EngineState]]:
        """Model -> the known engines serving it, in discovery order."""
        if self._by_model is None:
            self._by_model = {}
            for state in self._engines.values():
                for model in state.models:
                    self._by_model.setdefault(model, []).append(state)
        return self._by_model

    def models(self) -> list[str]:
        """Every model some known engine serves, sorted."""
        return sorted(self._index())

    def serves(self, model: str) -> bool:
        """Whether some known engine serves `model`."""
        return model in self._index()

    def _of(self, model: str, roles: Collection[Role]) -> tuple[EngineState, ...]:
        key = (model, tuple(roles))
        engines = self._of_model.get(key)
        if engines is None:
            engines = tuple(s for s in self._index().get(model, ()) if s.role in roles)
            self._of_model[key] = engines
        return engines

    def of_model(self, model: str, roles: Collection[Role]) -> list[EngineState]:
        """Known engines (available or not) serving `model` in one of `roles`."""
        return list(self._of(model, roles))

    def any_up(self, model: str, roles: Collection[Role]) -> bool:
        """Whether an engine of `model` in one of `roles` passed its last health check (an
        ejected one that passed since is up, though not yet available)."""
        return any(s.healthy for s in self._of(model, roles))

    def available(self, model: str, roles: Collection[Role]) -> list[EngineState]:
        """Engines serving `model` in one of `roles` that may take a request now."""
        now = time.monotonic()
        return [s for s in self._of(model, roles) if s.available(now)]

    def disaggregated_models(self) -> list[str]:
        """Every model some known prefill or decode engine serves, sorted."""
        roles = ("prefill", "decode")
        return sorted({m for s in self._engines.values() if s.role in roles for m in s.models})

    def compatible_pairs(self, model: str) -> int:
        """How many (prefill, decode) pairs of available engines of `model` can hand off KV."""
        decodes = self.available(model, DECODE_ROLES)
        return sum(
            p.can_pair_with(d) for p in self.available(model, PREFILL_ROLES) for d in decodes
        )


def _agree(mine: object, theirs: object) -> bool:
    return mine is None or theirs is None or mine == theirs
