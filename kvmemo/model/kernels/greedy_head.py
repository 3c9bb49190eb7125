"""The greedy head's exact fp32 refinement (greedy_head.c): among the candidate tokens of each row,
the one with the largest fp32 dot product (layers/greedy_head.py says why that is the argmax).

Invariant: the loaded function, or None (no C compiler, KVMEMO_CPU_KERNEL=0): then the caller
keeps the full fp32 head.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from pathlib import Path

from kvmemo.native import load_library

SOURCE = Path(__file__).with_name("greedy_head.c")


@cache
def refine_argmax_kernel() -> Callable[..., None] | None:
    library = load_library(SOURCE, "greedy decoding reads the full fp32 head")
    if library is None:
        return None
    fn = library.kvmemo_refine_argmax
    fn.restype = None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, i64, i64, p, i64, p, p, p, p]
    return fn
