"""A Llama layer's small ops in C (layer_ops.c): the residual add with the RMSNorm after it, RoPE in
place, and silu(gate) * up; each computes in fp32 and rounds once to the output dtype.

Invariant: each equals its torch composition to that rounding (tests/model/test_dense_forward.py);
the functions assume the kernel loaded (kernel_available) and inputs DenseForward.fits admits.
Why: a decode step's ~20 small torch ops per layer each cost microseconds of dispatch for
nanoseconds of work (models/llama_fast.py, DenseForward, says where the time went).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import cast

import torch

from kvmemo.native import load_library

SOURCE = Path(__file__).with_name("layer_ops.c")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_COLS = 16384  # layer_ops.c's row scratch

_p, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


@cache
def _library() -> ctypes.CDLL | None:
    library = load_library(SOURCE, "the model's small ops run through torch")
    if library is None:
        return None
    library.kvmemo_add_rmsnorm.argtypes = [_p, _i64, _i64, _p, _i32, _i64, _p, ctypes.c_float,
                                           _p, _i32]
    library.kvmemo_rope.argtypes = [_p, _i32, _i64, _i64, _i64, _i64, _p, _p]
    library.kvmemo_silu_mul.argtypes = [_p, _i64, _p, _i64, _i32, _i64, _i64, _p]
    for fn in (library.kvmemo_add_rmsnorm, library.kvmemo_rope, library.kvmemo_silu_mul):
        fn.restype = ctypes.c_int
    return library


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ValueError(f"layer_ops.{what}: unsupported dtype or width (fits() admits neither)")


def add_rmsnorm(hidden: torch.Tensor, addend: torch.Tensor | None, weight: torch.Tensor,
                eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """hidden [T, C] fp32 contiguous += addend [T, C] (rows with unit stride, fp32 or bf16) in
    place; returns rms_norm(hidden) * weight [T, C] in out_dtype."""
    library = cast(ctypes.CDLL, _library())
    rows, cols = hidden.shape
    out = torch.empty(rows, cols, dtype=out_dtype)
    add_ptr, add_code, add_ld = None, 0, 0
    if addend is not None:
        add_ptr, add_code, add_ld = addend.data_ptr(), DTYPE_CODES[addend.dtype], addend.stride(0)
    _check(library.kvmemo_add_rmsnorm(hidden.data_ptr(), rows, cols, add_ptr, add_code, add_ld,
                                      weight.data_ptr(), eps, out.data_ptr(),
                                      DTYPE_CODES[out_dtype]), "add_rmsnorm")
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_cols: int,
          head_dim: int) -> None:
    """Rotate-half RoPE in place on x [T, N]'s first rope_cols columns; cos/sin fp32 [T, D/2]
    contiguous."""
    library = cast(ctypes.CDLL, _library())
    _check(library.kvmemo_rope(x.data_ptr(), DTYPE_CODES[x.dtype], x.shape[0], x.stride(0),
                               rope_cols, head_dim, cos.data_ptr(), sin.data_ptr()), "rope")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] rows with unit stride, one dtype; a new contiguous tensor."""
    library = cast(ctypes.CDLL, _library())
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=gate.dtype)
    _check(library.kvmemo_silu_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
                                   DTYPE_CODES[gate.dtype], rows, cols, out.data_ptr()),
           "silu_mul")
    return out


def kernel_available() -> bool:
    """layer_ops.c built and loaded here."""
    return _library() is not None

