"""The lease table both transports serve from: expiry, holds under a read, claims."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from baton.kv_transfer.checksum import block_crcs
from baton.kv_transfer.leases import LeaseTable, Status


@pytest.fixture
def table() -> Iterator[LeaseTable]:
    kv = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
    t = LeaseTable(kv, "e")
    yield t
    t.stop()


def test_lookup_answers_checksums_in_the_order_asked(table: LeaseTable) -> None:
    table.lease("r", [5, 2, 3], time.time() + 30)
    status, crcs = table.lookup("e", "r", [3, 2], table.block_bytes, 5.0)
    assert status == Status.OK and crcs == block_crcs(table._kv, [3, 2])
    assert table.lookup("e", "r", [3, 4], table.block_bytes, 5.0) == (Status.BAD_BLOCKS, [])
    assert table.lookup("e", "nobody", [1], table.block_bytes, 5.0) == (Status.UNKNOWN_REQUEST, [])
    assert table.lookup("old", "r", [3], table.block_bytes, 5.0) == (Status.UNKNOWN_ENGINE, [])
    assert table.lookup("e", "r", [3], 1, 5.0) == (Status.BLOCK_SIZE_MISMATCH, [])
    with pytest.raises(ValueError, match="out of range"):
        table.lease("bad", [8], time.time() + 30)


def test_a_read_holds_the_lease_until_it_ends(table: LeaseTable) -> None:
    """A lease past its time is not expired while a read holds it; once the read ends (TCP's
    end_read) it expires, and a late reader hears EXPIRED."""
    table.lease("r", [1], time.time() + 30)
    assert table.lookup("e", "r", [1], table.block_bytes, 5.0)[0] == Status.OK
    assert table.holding() and table.reading.is_set()
    assert table.expire(time.time() + 60) == []  # held
    table.end_read("r")
    assert not table.holding() and not table.reading.is_set()
    assert table.expire(time.time() + 60) == ["r"]
    assert table.lookup("e", "r", [1], table.block_bytes, 5.0) == (Status.EXPIRED, [])


def test_a_hold_ends_at_its_deadline_or_a_claim(table: LeaseTable) -> None:
    """A reader that never says its read ended (NIXL's one-sided READ, or a reader that died)
    holds the lease only until its deadline; a claim ends the hold and reports the lease."""
    table.lease("dead", [1], time.time() + 30)
    table.lease("done", [2], time.time() + 30)
    table.lookup("e", "dead", [1], table.block_bytes, 0.05)
    table.lookup("e", "done", [2], table.block_bytes, 5.0)
    time.sleep(0.1)
    assert table.expire(time.time() + 60) == ["dead"]
    assert table.claim("e", "done") == Status.OK
    assert table.claim("e", "done") == Status.UNKNOWN_REQUEST
    assert table.claimed() == ["done"] and table.claimed() == []
    assert not table.holding()
