"""The CPU KV cache's memory (`model_runner.zeroed`): zeros without writing them, and 2 MiB pages
where the kernel's transparent huge pages wait to be asked for."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from baton.engine.worker.model_runner import zeroed

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The selected mode (`always`, `madvise` or `never`), None without THP."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds `t`, from /proc/self/smaps."""
    address, mapping = t.data_ptr(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            mapping = start <= address < end
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("the tensor's mapping is not in /proc/self/smaps")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_cache_starts_as_zeros_of_its_shape(dtype: torch.dtype) -> None:
    t = zeroed((3, 2, 16, 4), dtype, torch.device("cpu"))
    assert t.shape == (3, 2, 16, 4) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[1, 1] = 2.0
    assert t.sum() == 2.0 * 16 * 4
    assert zeroed((0, 4), dtype, torch.device("cpu")).shape == (0, 4)


def test_the_cache_asks_for_huge_pages_and_a_4k_copy_does_not() -> None:
    mode = _thp_mode()
    if mode not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {mode or 'absent'} on this kernel")
    size = (64 << 20) // 4  # 64 MiB of float32: many whole 2 MiB pages, wherever it starts
    # Whether the kernel has 2 MiB pages to give at all: a mapping asked for them directly.
    control = mmap.mmap(-1, size * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    control.madvise(mmap.MADV_HUGEPAGE)
    probe = torch.frombuffer(control, dtype=torch.float32)
    probe.fill_(1.0)
    if _huge_kib(probe) == 0:
        pytest.skip("the kernel had no free 2 MiB pages to give")
    huge = zeroed((size,), torch.float32, torch.device("cpu"))
    huge.fill_(1.0)  # first touch: the kernel picks the page size now
    assert _huge_kib(huge) >= 32 << 10  # at least half the mapping
    if mode == "madvise":  # only asked-for mappings get them
        small = zeroed((size,), torch.float32, torch.device("cpu"), huge_pages=False)
        small.fill_(1.0)
        assert _huge_kib(small) == 0


def test_a_kernel_that_refuses_the_advice_still_gets_its_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel built without THP answers MADV_HUGEPAGE with EINVAL; an unknown advice gets the
    same answer here. The engine starts on 4 KiB pages rather than failing."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no madvise advice on this platform")
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF)
    t = zeroed((4, 1024), torch.float32, torch.device("cpu"))
    assert t.shape == (4, 1024) and not t.any()
