"""File-backed pages dropped from this process's resident memory (MADV_DONTNEED).

Invariant: only for read-only mappings of files that nothing writes (a GGUF mapped read-only, a
library's code): there DONTNEED only unmaps the pages, which stay in the page cache and fault
back in, from memory, if touched again. Never on anonymous or writable memory, where it would
zero or discard data. Linux only; elsewhere nothing is done.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from functools import cache

_MADV_DONTNEED = 4


def drop_resident_pages(start: int, end: int) -> bool:
    """Unmaps the whole pages inside [start, end) (addresses); True if madvise accepted it."""
    libc = _libc()
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if libc is None or last <= first:
        return False
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) == 0


@cache
def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc
