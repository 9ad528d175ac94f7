"""One request's streams from the engine: a prompt's snapshots with their metrics, the merge and
collection of several prompts, and the event stream that aborts the engine's requests however it
ends (a client that leaves before a whole answer is `baton.http_server.cancel_on_disconnect`'s).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from baton.engine.api.metrics import EngineMetrics, RequestTimer
from baton.engine.async_llm import AsyncLLM, EngineDeadError
from baton.engine.outputs import RequestOutput
from baton.engine.sampling_params import SamplingParams
from baton.errors import APIError
from baton.http_server import body_writer
from baton.kv_transfer.params import KVTransferParams


class PromptStream:
    """One prompt's snapshots from the engine, with its metrics; errors become `APIError`s."""

    def __init__(
        self,
        llm: AsyncLLM,
        metrics: EngineMetrics,
        request_id: str,
        prompt: tuple[str | None, list[int]],
        params: SamplingParams,
        priority: int,
        kv_transfer_params: KVTransferParams | None = None,
        resume_token_ids: list[int] | None = None,  # a resumed answer's (`AsyncLLM.generate`)
        cache_salt: str | None = None,
    ) -> None:
        text, ids = prompt
        self._gen = llm.generate(
            request_id,
            ids,
            params,
            prompt=text,
            priority=priority,
            kv_transfer_params=kv_transfer_params,
            resume_token_ids=resume_token_ids,
            cache_salt=cache_salt,
            sink=self._offer,
        )
        # The snapshots of a resumed answer start with its resumed tokens: another engine
        # generated them (and counted them), so the metrics count from there.
        self._timer = RequestTimer(metrics, len(ids), params, len(resume_token_ids or []))
        self._closed = False
        self._handle: Callable[[RequestOutput], bool] | None = None
        self._failed: Exception | None = None  # what `_handle` raised
        self.last: RequestOutput | None = None

    def direct(self, handle: Callable[[RequestOutput], bool]) -> None:
        """From now on, while the reader waits in `next`, each snapshot but the last goes to
        `handle` first, in the engine's output loop: `handle` sends what the snapshot shows and
        returns True, or returns False (the reader gets the snapshot, and what `handle` made
        of it is the reader's to send). What it raises is raised by `next`."""
        self._handle = handle

    def _offer(self, out: RequestOutput) -> bool:
        if self._handle is None or self._failed is not None or out.error is not None:
            return False
        try:
            taken = self._handle(out)
        except Exception as e:  # never into the output loop: the reader raises it
            self._failed = e
            return False
        if taken:
            self._timer.on_output(out)
            self.last = out
        return taken

    async def next(self) -> RequestOutput | None:
        """The next snapshot, or None once the request has finished."""
        if self.last is not None and self.last.finished:
            return None
        try:
            out = await anext(self._gen)
        except StopAsyncIteration:
            return None
        except ValueError as e:  # raised before anything is queued: a bad prompt
            raise APIError(400, str(e), "prompt") from None
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None
        if self._failed is not None:
            raise self._failed
        self._timer.on_output(out)
        self.last = out
        if out.error is not None:  # the engine ended it (a failed KV load under policy "fail")
            raise APIError(out.error_status, out.error)
        return out

    async def close(self) -> None:
        """Aborts the request in the engine unless it finished (idempotent)."""
        if not self._closed:
            self._closed = True
            self._timer.on_closed()
            await self._gen.aclose()


async def merge(streams: list[PromptStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Later snapshots of several prompts, as they come. A stream's next snapshot is asked for
    only after the consumer took its previous one (snapshots share lists with the engine)."""
    pending = {asyncio.ensure_future(s.next()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if out is not None:
                    yield i, out
                    pending[asyncio.ensure_future(streams[i].next())] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def collect(streams: list[PromptStream]) -> list[RequestOutput]:
    """Every prompt's final snapshot."""

    async def run(stream: PromptStream) -> RequestOutput:
        while await stream.next() is not None:
            pass
        if stream.last is None:
            raise APIError(500, "the engine ended a request without output")
        return stream.last

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(run(s)) for s in streams]
    except* APIError as errors:  # the first one answers the client (the others were cancelled)
        raise errors.exceptions[0] from None
    return [t.result() for t in tasks]


class EventStream(Response):
    """Server-sent events, each sent as soon as the engine made it, whose cleanup runs however
    the response ends, even if no event went out (a client gone before the first byte): it
    aborts the engine requests.

    Not Starlette's StreamingResponse, which runs a task group per response and wraps every
    event on its way to the socket (as the router's `_PassThrough`, which says the same): here
    each event is written on the connection by the server's `body_writer` (one `send`, waiting
    for the client to drain, where it cannot), and one watcher task per stream waits for the
    client's disconnect and, if it comes, cancels the stream wherever it waits.

    `direct(write)`, if given, is called once the response has started: the producer may then
    write events with `write` itself (outside this task), while `events` waits for more. It must
    write only what `events` would have yielded at that point, and only while `events` waits
    (`PromptStream.direct` offers snapshots then). `write` returns False, having written
    nothing, where the events must go through `events` instead.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        cleanup: Callable[[], Awaitable[None]],
        direct: Callable[[Callable[[bytes], bool]], None] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})
        self._events = events
        self._cleanup = cleanup
        self._direct = direct

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.current_task()
        assert pump is not None
        gone = ended = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not ended:  # past the end, the cleanup must not be cut short
                gone = True
                pump.cancel()

        watcher = asyncio.ensure_future(watch())
        write = body_writer(scope)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if write is not None and self._direct is not None:
                self._direct(write)  # the producer may write events itself from now on
            async for event in self._events:
                body = event.encode()
                if write is None or not write(body):
                    await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            pump.uncancel()  # the client left: the stream just ends
        finally:
            ended = True
            watcher.cancel()
            await self._events.aclose()  # runs its `finally` if it was left at a `yield`
            await self._cleanup()


def cleanup_for(
    streams: list[PromptStream], release: Callable[[], None]
) -> Callable[[], Awaitable[None]]:
    """The call that ends a request: closes (aborts) its streams, then `release`s its admission."""

    async def cleanup() -> None:
        try:
            for s in streams:
                await s.close()
        finally:
            release()

    return cleanup
