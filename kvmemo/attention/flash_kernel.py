"""The compiled CPU flash-attention kernel (kernels/flash_attention.c), built and loaded by
kvmemo.native: prefill rows against contiguous keys with a per-row last visible key, returning
the output and the fp32 log-sum-exp.

Invariant: `flash_attention(...)` returns (o, lse) equal to softmax attention within float
tolerance, or None when the kernel cannot run the call (no compiler, no AVX-512, bf16 without
AVX512_BF16, head_dim not a multiple of 64 or above 512, KVMEMO_CPU_KERNEL=0 or
KVMEMO_FLASH_KERNEL=0); the caller then uses torch's flash kernel, which computes the same
values.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from kvmemo.native import load_library

SOURCE = Path(__file__).with_name("kernels") / "flash_attention.c"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


@cache
def _kernel() -> Callable[..., int] | None:
    if os.environ.get("KVMEMO_FLASH_KERNEL", "1") == "0":
        return None
    library = load_library(SOURCE, "CPU prefill attention uses torch's flash kernel")
    if library is None:
        return None
    fn = library.kvmemo_flash_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [
        _p, _p, _p, ctypes.c_int,  # q, k, v, dtype
        _i64, _i64, _i64, _i64, _i64,  # B, H, M, L, D
        _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64,  # q, k, v strides (b, h, row)
        _p, _i64, ctypes.c_float, _p, _p,  # limits, limits' batch stride, scale, out, lse
    ]
    return fn


def flash_attention(
    q: torch.Tensor,  # [B, H, M, D]: M query rows per (batch, kv head)
    k: torch.Tensor,  # [B, H, L, D]
    v: torch.Tensor,
    last_key: torch.Tensor | None,  # int64 [B, M] or [M]: the last key each row sees; None: all
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """o [B, H, M, D] fp32 and lse [B, H, M] fp32, or None (use torch's kernel instead)."""
    if (
        q.device.type != "cpu"
        or q.dtype not in DTYPE_CODES
        or k.dtype != q.dtype
        or v.dtype != q.dtype
        or q.shape[-1] % 64 != 0
        or q.stride(-1) != 1
        or k.stride(-1) != 1
        or v.stride(-1) != 1
    ):
        return None
    fn = _kernel()
    if fn is None:
        return None
    batch, heads, rows, head_dim = q.shape
    keys = k.shape[2]
    limits = None
    lim_stride = 0
    if last_key is not None:
        limits = last_key.to(torch.int64).reshape(-1, rows).contiguous()
        lim_stride = rows if limits.shape[0] > 1 else 0
    out = torch.empty(batch, heads, rows, head_dim, dtype=torch.float32)
    lse = torch.empty(batch, heads, rows, dtype=torch.float32)
    status = fn(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), DTYPE_CODES[q.dtype], batch, heads, rows,
        keys, head_dim, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        None if limits is None else limits.data_ptr(), lim_stride, scale, out.data_ptr(),
        lse.data_ptr(),
    )
    return (out, lse) if status == 0 else None
