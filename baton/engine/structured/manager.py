"""The EngineCore's structured outputs: one llguidance matcher per request, compiled on a small
thread pool so that the busy loop never waits on a grammar, and the batch's next-token bitmasks.

Call contract (vLLM V1's StructuredOutputManager, vllm/v1/structured_output/__init__.py): the
scheduler thread alone calls every method; `add_request` returns at once and the request is
scheduled only once `is_ready`; each step it asks `bitmask` for the batch, then feeds every
sampled token to `accept`; `remove` when the request ends. n > 1 is several requests, each with
its own matcher, sharing one compiled grammar through the compiler's cache.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from baton.engine.sampling_params import StructuredOutputsParams
from baton.engine.structured.backend import GrammarCompiler

logger = logging.getLogger(__name__)

# From this many constrained rows on, masks are filled by llguidance's executor on its own
# threads (in Rust, without the GIL); below it one by one, where the hand-off costs more than
# it saves: bench/grammar_backends.py measured the two even at 8 rows on 2 CPUs, the parallel
# fill 20% faster at 32.
PARALLEL_FILL_MIN_ROWS = 8
# A request's grammar may cost this much per token's mask (realistic schemas take 5-700 us on a
# 49k vocabulary, p99): one that takes more, MASK_STRIKES times, is ended with an error, since
# the mask is made on the busy loop and would stall every other request's tokens. A client can
# send an ambiguous grammar that compiles in a millisecond and then takes 50-250 ms a token.
MASK_BUDGET_S = 0.02
MASK_STRIKES = 3


@dataclass
class _Request:
    params: StructuredOutputsParams
    matcher: Future[llguidance.LLMatcher]
    # The constraint is inactive until the output ends with `params.after_token_ids`; `tail`
    # holds the last output tokens while it waits for them.
    active: bool
    tail: list[int] = field(default_factory=list)
    strikes: int = 0  # masks that took longer than MASK_BUDGET_S
    failure: str | None = None  # why the grammar gave up after it compiled


class StructuredOutputManager:
    """Matchers and bitmasks for the requests with a `structured_outputs` constraint; ids it
    was not given are unconstrained (all-ones rows, every token accepted)."""

    def __init__(self, compiler: GrammarCompiler, max_workers: int = 2) -> None:
        self.compiler = compiler
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._requests: dict[str, _Request] = {}
        self._executor: llguidance.LLExecutor | None = None
        self._words = (compiler.vocab_size + 31) // 32  # the bitmask's width, by the logits
        # llguidance's masks are as wide as its tokenizer, which may know more ids than the
        # logits have (then the extra words are dropped) or fewer (then they are zeros).
        self._ll_words = (compiler.ll_tokenizer.vocab_size + 31) // 32

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Starts compiling the request's grammar (or takes it from the cache) and returns."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already has a structured outputs matcher")
        future = self._pool.submit(lambda: self.compiler.compile(params).matcher())
        self._requests[request_id] = _Request(params, future, active=not params.after_token_ids)

    def is_ready(self, request_id: str) -> bool:
        """Compiled or failed: the request may be scheduled (or ended, see `error`)."""
        req = self._requests.get(request_id)
        return req is None or req.matcher.done()

    def error(self, request_id: str) -> str | None:
        """Why the request's grammar did not compile; None while compiling or when it did."""
        req = self._requests.get(request_id)
        if req is None or not req.matcher.done():
            return None
        e = req.matcher.exception()
        if e is not None:
            return str(e) or type(e).__name__
        return req.failure

    def bitmask(self, request_ids: Sequence[str]) -> np.ndarray | None:
        """The batch's next-token bitmask: int32 `[len(request_ids), ceil(vocab_size / 32)]`,
        bit t of row i set when request i may sample token t next. A row with no active
        constraint is all ones; None when no row has one. A request still compiling is waited
        for (the scheduler should not have scheduled it). A matcher that is done or that
        rejected a token allows only EOS."""
        rows: list[tuple[llguidance.LLMatcher, int]] = []
        for i, request_id in enumerate(request_ids):
            matcher = self._active_matcher(request_id)
            if matcher is not None:
                rows.append((matcher, i))
        if not rows:
            return None
        full = llg_numpy.allocate_token_bitmask(len(request_ids), self._ll_words * 32)
        start = time.perf_counter()
        if len(rows) >= PARALLEL_FILL_MIN_ROWS:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(min(8, os.cpu_count() or 1))
            llg_numpy.fill_next_token_bitmask_par(self._executor, rows, full)
        if len(rows) < PARALLEL_FILL_MIN_ROWS or time.perf_counter() - start > MASK_BUDGET_S:
            # One by one, timed: a batch over the budget is filled again to find who is slow.
            for matcher, i in rows:
                start = time.perf_counter()
                llg_numpy.fill_next_token_bitmask(matcher, full, i)
                self._charge(request_ids[i], time.perf_counter() - start)
        mask = (
            full if self._ll_words == self._words else np.ascontiguousarray(full[:, : self._words])
        )
        tail_bits = self.compiler.vocab_size % 32
        if tail_bits and self.compiler.ll_tokenizer.vocab_size > self.compiler.vocab_size:
            # ids past the logits in the last word are no sampleable token
            keep = np.int32(np.uint32((1 << tail_bits) - 1).view(np.int32))
            mask[[i for _, i in rows], -1] &= keep
        return mask

    def _charge(self, request_id: str, seconds: float) -> None:
        req = self._requests[request_id]
        if seconds <= MASK_BUDGET_S:
            return
        req.strikes += 1
        if req.strikes >= MASK_STRIKES and req.failure is None:
            req.failure = (
                f"the grammar takes {seconds * 1e3:.0f} ms a token to follow, more than the "
                f"{MASK_BUDGET_S * 1e3:.0f} ms the engine allows (it would stall every other "
                "request); simplify it (an ambiguous grammar is the usual cause)"
            )

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advances the request's matcher by one sampled token; False when the grammar rejects
        it (the matcher then allows only EOS). Before the constraint is active the token only
        counts towards `after_token_ids`, which activates it from the next token on."""
        req = self._requests.get(request_id)
        if req is None:
            return True
        if not req.active:
            after = req.params.after_token_ids or ()
            req.tail = [*req.tail, token_id][-len(after) :]
            req.active = tuple(req.tail) == after
            return True
        if req.matcher.exception() is not None or req.strikes >= MASK_STRIKES:
            return False  # did not compile, or gave up: too costly to follow
        matcher = req.matcher.result()
        if matcher.is_stopped() and not matcher.is_error():
            # Complete: the EOS that ends the request is all that may come.
            ok = token_id in self.compiler.eos_token_ids
        else:
            ok = bool(matcher.consume_token(token_id))
        if not ok:
            # The mask allowed nothing the sampler could take (the request's allowed_token_ids,
            # bad_words or logit_bias left its grammar no token), or llguidance gave up.
            req.failure = (
                f"token {token_id} breaks the grammar: the request's allowed_token_ids, "
                "bad_words or logit_bias leave the grammar no token it may take"
            )
            if matcher.is_error():  # llguidance's own word, the last line of its report
                lines = [x for x in matcher.get_error().splitlines() if x.startswith("Error:")]
                if lines:
                    req.failure += f" ({lines[-1][:200]})"
        return ok

    def is_terminated(self, request_id: str) -> bool:
        """The request's grammar is complete: only EOS may follow (also after it was taken)."""
        matcher = self._active_matcher(request_id)
        return matcher is not None and matcher.is_stopped() and not matcher.is_error()

    def remove(self, request_id: str) -> None:
        """Forgets the request; a compile it started still fills the compiler's cache."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            req.matcher.cancel()

    def close(self) -> None:
        """Stops the compile pool (compiles under way finish first)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _active_matcher(self, request_id: str) -> llguidance.LLMatcher | None:
        req = self._requests.get(request_id)
        if req is None or not req.active or req.matcher.exception() is not None:
            return None
        return req.matcher.result()


class DeferredManager:
    """A `StructuredOutputManager` built on a thread of its own: loading the tokenizer and
    indexing its vocabulary takes 0.3 s and more (49k tokens; 128k+ vocabularies longer), which
    the engine's first constrained request would otherwise spend on the busy loop, stalling
    every stream. Until it is built its requests wait (`is_ready` False), as for a compile; if it
    fails, every constrained request ends with the reason (`error`), and it is not retried."""

    def __init__(self, build: Callable[[], StructuredOutputManager]) -> None:
        self._built: Future[StructuredOutputManager] = Future()
        self._pending: dict[str, StructuredOutputsParams] = {}
        threading.Thread(
            target=self._build, args=(build,), name="grammar-setup", daemon=True
        ).start()

    def _build(self, build: Callable[[], StructuredOutputManager]) -> None:
        try:
            self._built.set_result(build())
        except BaseException as e:
            logger.exception("structured outputs are unavailable")
            self._built.set_exception(e)

    def _manager(self) -> StructuredOutputManager | None:
        if not self._built.done() or self._built.exception() is not None:
            return None
        manager = self._built.result()
        for request_id, params in self._pending.items():
            manager.add_request(request_id, params)
        self._pending.clear()
        return manager

    def _get(self) -> StructuredOutputManager:
        manager = self._manager()
        assert manager is not None, "a constrained request ran before its grammar was ready"
        return manager

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        manager = self._manager()
        if manager is None:
            self._pending[request_id] = params
        else:
            manager.add_request(request_id, params)

    def is_ready(self, request_id: str) -> bool:
        if not self._built.done():
            return False
        manager = self._manager()
        return manager is None or manager.is_ready(request_id)

    def error(self, request_id: str) -> str | None:
        if self._built.done() and (e := self._built.exception()) is not None:
            return f"structured outputs are unavailable: {type(e).__name__}: {e}"
        manager = self._manager()
        return manager.error(request_id) if manager is not None else None

    def bitmask(self, request_ids: Sequence[str]) -> np.ndarray | None:
        return self._get().bitmask(request_ids)

    def accept(self, request_id: str, token_id: int) -> bool:
        return self._get().accept(request_id, token_id)

    def is_terminated(self, request_id: str) -> bool:
        return self._get().is_terminated(request_id)

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        manager = self._manager()
        if manager is not None:
            manager.remove(request_id)
