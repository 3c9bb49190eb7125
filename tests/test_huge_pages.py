"""huge_pages: 64-byte aligned buffers in mappings advised for 2 MiB pages, shared chunks for
small buffers, each mapping returned when its last tensor goes."""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import pytest
import torch

from kvmemo.huge_pages import HUGE_PAGE, HugePageArena, huge_page_empty

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry (its range and fields) of the mapping holding `address`."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if entry is not None:
                return entry
            start, end = (int(x, 16) for x in head.groups())
            entry = {"range": line} if start <= address < end else None
        elif entry is not None and ":" in line:
            key, value = line.split(":", 1)
            entry[key] = value.strip()
    return entry


def _thp_available() -> bool:
    return sys.platform == "linux" and THP_SETTING.exists() and "[never]" not in THP_SETTING.read_text()


def test_small_buffers_share_a_chunk_aligned_and_apart() -> None:
    arena = HugePageArena(chunk_bytes=4 * HUGE_PAGE)
    sizes = [1, 100, 64, 3000, 777]
    buffers = [arena.empty(n) for n in sizes]
    for buffer, n in zip(buffers, sizes):
        assert buffer.dtype == torch.uint8 and buffer.numel() == n and buffer.data_ptr() % 64 == 0
    for i, buffer in enumerate(buffers):  # each written with its own value, none overwritten
        buffer.fill_(i + 1)
    for i, buffer in enumerate(buffers):
        assert torch.all(buffer == i + 1)
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] - spans[0][0] < 4 * HUGE_PAGE  # one chunk


def test_a_full_chunk_starts_another_and_large_buffers_get_their_own() -> None:
    arena = HugePageArena(chunk_bytes=2 * HUGE_PAGE)
    first, second = arena.empty(HUGE_PAGE), arena.empty(HUGE_PAGE // 2)
    third = arena.empty(HUGE_PAGE)  # does not fit beside the first two
    assert second.data_ptr() == first.data_ptr() + HUGE_PAGE
    assert not first.data_ptr() <= third.data_ptr() < first.data_ptr() + 2 * HUGE_PAGE
    large = arena.empty(3 * HUGE_PAGE + 5)
    if sys.platform == "linux":
        assert large.data_ptr() % HUGE_PAGE == 0
    large[-1] = 7
    assert int(large[-1]) == 7


@pytest.mark.parametrize("size", [0, -1])
def test_a_size_that_is_not_positive_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        HugePageArena().empty(size)


@pytest.mark.skipif(not _thp_available(), reason="no transparent huge pages on this system")
def test_buffers_are_advised_for_huge_pages() -> None:
    for size in (1000, 64 << 20):
        buffer = huge_page_empty(size)
        mapping = _mapping_of(buffer.data_ptr())
        assert mapping is not None and mapping.get("THPeligible") == "1", mapping


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
def test_a_large_buffers_mapping_goes_with_its_tensor() -> None:
    buffer = huge_page_empty(64 << 20)
    address = buffer.data_ptr()
    view = buffer[10:20]  # a view keeps the mapping alive
    del buffer
    gc.collect()
    assert _mapping_of(address) is not None
    del view
    gc.collect()
    assert _mapping_of(address) is None


@pytest.mark.skipif(not _thp_available(), reason="no transparent huge pages on this system")
def test_repacked_weights_live_on_huge_pages() -> None:
    from gguf import GGMLQuantizationType

    from kvmemo.model.kernels import quant_int8
    from kvmemo.model.kernels.quant_linear import QuantizedWeight
    from tests.model.test_quant_linear import random_blocks

    raw = random_blocks(GGMLQuantizationType.Q8_0, 64, 256, seed=3)
    packed = quant_int8.repacked(QuantizedWeight.from_numpy("w", GGMLQuantizationType.Q8_0, raw))
    if packed is None:
        pytest.skip("this CPU's build reads the GGUF bytes as they are")
    mapping = _mapping_of(packed.data_ptr())
    assert mapping is not None and mapping.get("THPeligible") == "1", mapping
