"""Requests held while their model has no engine up, as Knative's activator holds them for a
revision at zero: one bounded FIFO of waiters per model, let go in arrival order when an engine
of the model comes up, answered 503 with `Retry-After` when their time runs out, their queue is
full or the router stops. `baton:router_held_requests{model}` is what wakes a pool at zero.

The router decides whether a request must wait (`Router.generate`) and when an engine came up;
this module only keeps the waiters, their bounds and their metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable

from starlette.responses import Response

from baton.errors import APIError
from baton.router.metrics import HoldOutcome, RouterMetrics

logger = logging.getLogger(__name__)

# What a refused client is told to wait before it tries again: an engine is starting (minutes
# for a large model, but the pool may already be close), or another router replica is there.
RETRY_AFTER_SECONDS = 5
RETRY_AFTER_SHUTDOWN_SECONDS = 1


class HoldError(APIError):
    """A 503 in OpenAI's error shape with a `Retry-After` header."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_SECONDS) -> None:
        super().__init__(503, message)
        self.retry_after = retry_after

    def response(self) -> Response:
        response = super().response()
        response.headers["retry-after"] = str(self.retry_after)
        return response


class Holds:
    """The held requests of every model the router knows. Used only on the router's loop."""

    def __init__(
        self, timeout: float, queue_size: int, metrics: RouterMetrics, models: Iterable[str] = ()
    ) -> None:
        self.timeout = timeout  # seconds a request waits at most
        self.queue_size = queue_size  # waiters per model at most
        self.metrics = metrics
        # Per model, its waiters in arrival order; each future is resolved with how its hold
        # ended ("released", "shutdown"). Plain futures rather than an asyncio.Condition: a
        # waiter that leaves is removed by identity, and the deque's length is the gauge.
        self._queues: dict[str, deque[asyncio.Future[HoldOutcome]]] = {}
        self._closed = False
        for model in models:
            self.know(model)

    def know(self, model: str) -> None:
        """Remembers `model` (for good): its requests may be held, its gauge shows 0."""
        if model not in self._queues:
            self._queues[model] = deque()
            self.metrics.hold_model(model)

    def knows(self, model: str) -> bool:
        return model in self._queues

    def models(self) -> list[str]:
        """Every model known, sorted."""
        return sorted(self._queues)

    async def hold(self, model: str) -> None:
        """Waits until `release(model)`; HoldError (503, `Retry-After`) when the queue is full,
        the wait passes `timeout`, or the router stops. Cancelled (the client left), the request
        leaves the queue."""
        if self._closed:
            self.metrics.hold_outcome(model, "shutdown", None)
            raise HoldError("the router is stopping", RETRY_AFTER_SHUTDOWN_SECONDS)
        self.know(model)
        queue = self._queues[model]
        if len(queue) >= self.queue_size:
            self.metrics.hold_outcome(model, "rejected", None)
            raise HoldError(
                f"no engine of the model `{model}` is up, and {len(queue)} requests already "
                f"wait for one"
            )
        waiter: asyncio.Future[HoldOutcome] = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        self.metrics.held(model, len(queue))
        if len(queue) == 1:
            logger.info("model %s has no engine up: holding its requests", model)
        started = time.monotonic()
        outcome: HoldOutcome = "abandoned"
        try:
            async with asyncio.timeout(self.timeout):
                outcome = await waiter
        except TimeoutError:
            outcome = "timed_out"
        finally:
            if waiter in queue:  # out of time or cancelled (which cancels `waiter` too)
                queue.remove(waiter)
                self.metrics.held(model, len(queue))
            self.metrics.hold_outcome(model, outcome, time.monotonic() - started)
        if outcome == "timed_out":
            raise HoldError(f"no engine of the model `{model}` came up in {self.timeout:g} s")
        if outcome == "shutdown":
            raise HoldError("the router is stopping", RETRY_AFTER_SHUTDOWN_SECONDS)

    def release(self, model: str) -> None:
        """Lets every request held for `model` go on to routing, in arrival order (each
        resumes in the order its future was resolved)."""
        queue = self._queues.get(model)
        if queue:
            logger.info("model %s has an engine up: releasing %d held requests", model, len(queue))
            self._end(model, queue, "released")

    def close(self) -> None:
        """The router stops: every held request is answered at once (503, `Retry-After`),
        and any that would be held from now on too."""
        self._closed = True
        for model, queue in self._queues.items():
            self._end(model, queue, "shutdown")

    def _end(self, model: str, queue: deque[asyncio.Future[HoldOutcome]], how: HoldOutcome) -> None:
        while queue:
            waiter = queue.popleft()
            if not waiter.done():
                waiter.set_result(how)
        self.metrics.held(model, 0)
