"""Where the router learns which engines exist: the `Endpoint` record and the `Discovery` contract,
with the static list given on the command line. Kubernetes discovery (EndpointSlices) lives in
`k8s_discovery.py` and keeps the same contract.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from baton.roles import ROLES, Role


@dataclass(frozen=True)
class Endpoint:
    """One engine server the router may send requests to."""

    url: str  # base URL without a trailing slash, e.g. "http://10.0.0.7:8000"
    role: Role
    # Served model name when discovery knows it (Kubernetes does); None means the router asks
    # the engine's /v1/models.
    model: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"engine role must be one of {ROLES}, got {self.role!r}")
        if not self.url.startswith(("http://", "https://")) or self.url.endswith("/"):
            raise ValueError(
                f"engine URL must be http(s)://host:port without a trailing /: {self.url!r}"
            )


# Called with the complete current set every time it changes (not a diff), so a consumer that
# misses a call still converges on the next one.
OnChange = Callable[[frozenset[Endpoint]], None]


class Discovery(Protocol):
    """A source of engine endpoints."""

    async def run(self, on_change: OnChange) -> None:
        """Call `on_change` with the current set at start and after every change; runs until
        cancelled. Must not raise on a transient API error (log it and retry)."""
        ...


class StaticDiscovery:
    """A fixed list of engines (`--prefill URL --decode URL --engine URL`)."""

    def __init__(self, endpoints: Iterable[Endpoint]) -> None:
        self.endpoints = frozenset(endpoints)

    async def run(self, on_change: OnChange) -> None:
        on_change(self.endpoints)
