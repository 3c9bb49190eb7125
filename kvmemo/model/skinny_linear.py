"""linear(): F.linear, but few-row fp32 inputs on CPU go through a C kernel that streams W once.

Invariant: equals F.linear(x, weight, bias) to fp32 rounding for every input; the kernel runs only
for CPU fp32 [M, K] inputs with M <= MAX_ROWS and a contiguous fp32 weight, else (or without a C
compiler, see kvmemo.native) F.linear does. Why: a decode step multiplies a few rows by every
weight matrix and is bound by reading the weights; MKL streamed them at 7-12 GB/s for 1-16 rows
here, the kernel (kernels/skinny_linear.c) at 12-24 GB/s (2 threads, 150 distinct 1,536 x 576
weights, 531 MB per pass).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kvmemo.native import load_library

SOURCE = Path(__file__).with_name("kernels") / "skinny_linear.c"
# Measured crossover (2 threads, weights streaming from DRAM, ms per 150 products with MKL vs the
# kernel): 1 row 42.6 / 22.5, 8 rows 63.7 / 35.5, 16 rows 69.3 / 44.4, 32 rows 93.2 / 75.3.
# Prefill chunks (hundreds of rows) are compute-bound, where MKL's packed GEMM is far ahead.
MAX_ROWS = 32


@cache
def _kernel() -> Callable[..., None] | None:
    library = load_library(SOURCE, "few-row linear layers use F.linear")
    if library is None:
        return None
    fn = library.kvmemo_skinny_linear
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    return fn


def kernel_available() -> bool:
    """The C kernel built and loaded on this machine (else linear() always uses F.linear)."""
    return _kernel() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N]; any other shape goes to F.linear."""
    if (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        # Raw pointers: anything F.linear would reject (another device, mismatched K) must go
        # there for its error, never into the kernel.
        and x.device.type == weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[1] == x.shape[1]
        and x.dtype == weight.dtype == torch.float32
        and weight.is_contiguous()
        # The kernel has no backward: leave products autograd needs to F.linear.
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        kernel = _kernel()
        if kernel is not None:
            x = x.contiguous()
            (num_rows, num_in), num_out = x.shape, weight.shape[0]
            out = torch.empty(num_rows, num_out, dtype=torch.float32)
            kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), num_rows, num_out, num_in)
            return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)
