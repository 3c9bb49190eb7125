"""Host buffers on 2 MiB pages: the repacked weights, which every decode step streams through.

A decode step reads all of a model's weights once (Gemma 3's 178 MB head among them). With 4 KiB
pages each thread crosses a page, and may miss the TLB and walk the page table, every 4 KiB, and
the CPU's prefetchers stop at every such boundary. Asked for transparent huge pages
(MADV_HUGEPAGE, before the memory is first written, so that its first faults map 2 MiB pages),
Gemma 3's head product on a Zen 3 VM read 24.5-26.0 GB/s instead of 22.9-24.7, SmolLM2's
23.8 instead of 20.8 (the same bytes, copies alternating in one process).

Invariant: a buffer from `huge_page_empty` is an ordinary CPU uint8 tensor, 64-byte aligned,
that keeps its mapping alive; only the page size differs, never a value. Where the kernel has
no transparent huge pages ("never" in /sys/kernel/mm/transparent_hugepage/enabled, or not
Linux) the advice is ignored and the pages are ordinary ones.
Why an arena: most weights are far smaller than 2 MiB (a SmolLM2 layer's q_proj is 0.2 MB), so
they are placed one after another in shared chunks; a chunk's memory is returned when the last
tensor in it is freed (the chunk being filled is also held here, so at most one chunk outlives
its weights). Untouched pages of a chunk are never resident.
"""

from __future__ import annotations

import mmap
import sys
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 32 << 20  # a chunk of small buffers; larger ones get a mapping of their own
ALIGN = 64  # a cache line: no load splits one


class HugePageArena:
    """Bump allocation of 64-byte aligned uint8 buffers in 2 MiB-aligned chunks advised
    MADV_HUGEPAGE."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # the chunk being filled
        self._used = 0
        self._lock = threading.Lock()

    def empty(self, size: int) -> torch.Tensor:
        """An uninitialized uint8 tensor of `size` bytes on 2 MiB pages where the OS gives them."""
        if size <= 0:
            raise ValueError(f"a buffer of {size} bytes: the size must be positive")
        if size > self.chunk_bytes // 2:
            return _mapping(size)  # its own mapping: freed with it
        with self._lock:
            if self._chunk is None or self._used + size > self._chunk.numel():
                self._chunk, self._used = _mapping(self.chunk_bytes), 0
            start = self._used
            self._used = -(-(start + size) // ALIGN) * ALIGN
            return self._chunk[start : start + size]


def _mapping(size: int) -> torch.Tensor:
    """`size` bytes at the start of a fresh anonymous private mapping, 2 MiB aligned and advised
    MADV_HUGEPAGE (a 64-byte aligned view of the plain allocator's where that cannot be had)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if sys.platform != "linux" or advice is None:
        plain = torch.empty(size + ALIGN, dtype=torch.uint8)
        start = (-plain.data_ptr()) % ALIGN
        return plain[start : start + size]
    # Private: a shared anonymous mapping is shmem, which takes huge pages only where
    # shmem_enabled allows (off by default).
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # a kernel built without transparent huge pages: ordinary pages
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start : start + size]


_ARENA = HugePageArena()


def huge_page_empty(size: int) -> torch.Tensor:
    """An uninitialized, 64-byte aligned uint8 CPU tensor of `size` bytes from the process's
    arena (HugePageArena): for buffers read in full on every step, such as repacked weights."""
    return _ARENA.empty(size)
