"""`AsyncLLM`'s per-request stream: which snapshots its sink is offered (the output loop writing
a streamed answer's tokens itself) and which reach the reader."""

from __future__ import annotations

import asyncio

from baton.engine.async_llm import _Stream
from baton.engine.outputs import RequestOutput


def _snapshot(n: int, finished: bool = False) -> RequestOutput:
    out = RequestOutput("r", None, [1, 2, 3])
    out.num_cached_tokens = n  # tells the snapshots apart
    out.finished = finished
    return out


def test_the_sink_gets_what_comes_while_the_reader_waits_and_never_the_last() -> None:
    async def go() -> tuple[list[int], list[int]]:
        taken: list[int] = []
        stream = _Stream(lambda out: taken.append(out.num_cached_tokens) is None)
        read: list[int] = []

        async def reader() -> None:
            while not (out := await stream.get()).finished:
                read.append(out.num_cached_tokens)
            read.append(out.num_cached_tokens)

        task = asyncio.ensure_future(reader())
        stream.put(_snapshot(0))  # the reader has not started waiting: it gets this one
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # now it waits
        stream.put(_snapshot(1))
        stream.put(_snapshot(2))
        stream.put(_snapshot(3, finished=True))
        await task
        return taken, read

    taken, read = asyncio.run(go())
    assert taken == [1, 2]
    assert read == [0, 3]


def test_a_declined_snapshot_and_those_after_it_until_read_go_to_the_reader() -> None:
    """A snapshot the sink declines wakes the reader; until the reader has taken it, later ones
    are not offered (they would overtake it), and the reader gets the latest."""

    async def go() -> tuple[list[int], list[int]]:
        offered: list[int] = []

        def sink(out: RequestOutput) -> bool:
            offered.append(out.num_cached_tokens)
            return out.num_cached_tokens != 1

        stream = _Stream(sink)
        read: list[int] = []
        waiting = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        stream.put(_snapshot(0))  # taken
        stream.put(_snapshot(1))  # declined: the reader wakes
        stream.put(_snapshot(2))  # not offered: the reader has not taken 1 yet
        read.append((await waiting).num_cached_tokens)
        waiting = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        stream.put(_snapshot(3))  # offered again
        stream.put(_snapshot(4, finished=True))
        read.append((await waiting).num_cached_tokens)
        return offered, read

    offered, read = asyncio.run(go())
    assert offered == [0, 1, 3]
    assert read == [2, 4]


def test_without_a_sink_every_snapshot_reaches_the_reader() -> None:
    async def go() -> int:
        stream = _Stream()
        waiting = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        stream.put(_snapshot(7))
        return (await waiting).num_cached_tokens

    assert asyncio.run(go()) == 7
