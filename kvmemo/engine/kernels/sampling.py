"""Temperature-only sampling rows through one C call (kernels/sampling.c).

Invariant: `sample_rows(logits, temperatures, uniforms)` returns, for every row, the token that
Sampler's torch path (softmax of logits / temperature, cumulative sum, search for uniform x
total) draws for the same uniform, up to fp32 rounding of the sums; it is used only for rows
without top-k, top-p or min-p cuts, on CPU, and returns None where the kernel cannot run (no C
compiler, KVMEMO_FUSED_SAMPLING=0), so the caller keeps its torch path.
Why: a served decode step samples 64 rows of a 49,152-token vocabulary at temperature 1; torch's
path makes four passes over 12.6 MB and two temporaries of that size, a few ms per step.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path
from typing import Callable

import torch

from kvmemo.native import load_library

SOURCE = Path(__file__).with_name("sampling.c")


@cache
def _kernel() -> Callable[..., int] | None:
    if os.environ.get("KVMEMO_FUSED_SAMPLING", "1") == "0":
        return None
    library = load_library(SOURCE, "sampling uses torch's softmax and cumsum")
    if library is None:
        return None
    fn = library.kvmemo_sample_rows
    fn.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, i64, i64, p, p, p]
    return fn


def can_sample_rows(logits: torch.Tensor) -> bool:
    """The kernel is here and takes these logits: [n, vocab] fp32 on CPU, rows of unit stride."""
    return (_kernel() is not None and logits.device.type == "cpu"
            and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1)


def sample_rows(logits: torch.Tensor, temperatures: list[float],
                uniforms: list[float]) -> list[int] | None:
    """Token ids for logits that can_sample_rows takes, every row usable (a finite maximum, no
    NaN); None when the kernel cannot run this call (or a row's scratch is not allocated)."""
    kernel = _kernel()
    if kernel is None or not can_sample_rows(logits):
        return None
    rows, vocab = logits.shape
    temps = torch.tensor(temperatures, dtype=torch.float32)
    draws = torch.tensor(uniforms, dtype=torch.float32)
    out = torch.empty(rows, dtype=torch.int64)
    if kernel(logits.data_ptr(), rows, vocab, logits.stride(0), temps.data_ptr(),
              draws.data_ptr(), out.data_ptr()) != 0:
        return None  # out of memory for a row's scratch
    tokens = out.tolist()
    return None if min(tokens, default=0) < 0 else tokens
