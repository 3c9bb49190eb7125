"""glibc malloc tuned for CPU inference: freed activation buffers stay in the process.

Invariant: only glibc's mmap/trim thresholds change (never what any allocation returns), to the
same values at every CPU engine start (so repeating it is harmless); nothing is done without
glibc, where the user tuned malloc already (MALLOC_*_ or GLIBC_TUNABLES in the environment), or
where another allocator is preloaded (tcmalloc, jemalloc, mimalloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Protocol

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
# Why: by default glibc serves a block above its mmap threshold (128 KiB at first, growing to at
# most 32 MiB) with a fresh mapping and unmaps it on free, and trims the heap top past 128 KiB.
# A prefill layer allocates ~30 MB of activations, so every layer faulted them in again page by
# page: 100-120k minor faults per W1 prefill step, 0.6 of its 3.4 s. The largest threshold
# mallopt accepts on 64-bit is 32 MiB; bigger blocks (weights, the KV pool) keep their mappings.
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2**30  # free heap kept for the next step, at most
TOP_PAD_BYTES = 64 * 2**20  # heap grown in steps this large: fewer brk calls and fresh pages


class _Mallopt(Protocol):
    def mallopt(self, param: int, value: int) -> int: ...


def keep_freed_memory(libc: _Mallopt | None = None, environ: dict[str, str] | None = None) -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if they were set."""
    environ = dict(os.environ) if environ is None else environ
    user_tuned = [
        k for k in environ if k == "GLIBC_TUNABLES" or (k.startswith("MALLOC_") and k.endswith("_"))
    ]
    preload = environ.get("LD_PRELOAD", "")
    if user_tuned or any(name in preload for name in ("tcmalloc", "jemalloc", "mimalloc")):
        why = ", ".join(user_tuned) or f"LD_PRELOAD={preload}"
        logger.info("malloc left as configured (%s)", why)
        return False
    if libc is None:
        libc = _load_glibc()
        if libc is None:
            return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                (M_TOP_PAD, TOP_PAD_BYTES))
    # mallopt returns 1 on success, 0 when it refuses a value.
    if not all(libc.mallopt(param, value) == 1 for param, value in settings):
        logger.warning("glibc refused the malloc thresholds: prefill may page-fault its buffers")
        return False
    return True


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the system now (glibc's malloc_trim); True if done.

    For a one-off release at start (the plain weights dropped once oneDNN holds packed copies):
    the raised trim threshold would otherwise keep those pages in the process for good.
    """
    libc = _load_glibc()
    if libc is None:
        return False
    trim = libc.malloc_trim  # type: ignore[attr-defined]
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def _load_glibc() -> _Mallopt | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it (musl, macOS: no mallopt thresholds)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc
