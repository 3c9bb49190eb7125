"""The compiled CPU flash-attention kernel (kernels/flash_attention.c), built and loaded by
kvmemo.native: prefill rows against contiguous keys with a per-row last visible key, returning
the output and the fp32 log-sum-exp.

Invariant: `flash_attention(...)` returns (o, lse) equal to softmax attention within float
tolerance, or None when the kernel cannot run the call (no compiler, no AVX-512, bf16 without
AVX512_BF16, head_dim not a multiple of 64 or above 512, KVMEMO_CPU_KERNEL=0 or
KVMEMO_FLASH_KERNEL=0); the caller then uses torch's flash kernel, which computes the same
values.

pack_kv + flash_attention_packed split a call in two for keys that many calls read unchanged: a
decode step's shared prefix, packed into the kernel's tiles once and attended by every later
step (packing is a third of each such call at 96 rows x 1,024 keys).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kvmemo.native import load_library

SOURCE = Path(__file__).with_name("flash_attention.c")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVMEMO_FLASH_KERNEL", "1") == "0":
        return None
    library = load_library(SOURCE, "CPU prefill attention uses torch's flash kernel")
    if library is None:
        return None
    strides = [_i64] * 3  # batch, head, row
    library.kvmemo_flash_attention.restype = ctypes.c_int
    library.kvmemo_flash_attention.argtypes = [
        _p, _p, _p, ctypes.c_int,  # q, k, v, dtype
        _i64, _i64, _i64, _i64, _i64,  # B, H, M, L, D
        *strides, *strides, *strides,  # q, k, v strides
        _p, _i64, ctypes.c_float, _p, _p,  # limits, limits' batch stride, scale, out, lse
    ]
    library.kvmemo_flash_packed_bytes.restype = _i64
    library.kvmemo_flash_packed_bytes.argtypes = [ctypes.c_int, _i64, _i64, _i64, _i64]
    library.kvmemo_flash_pack.restype = ctypes.c_int
    library.kvmemo_flash_pack.argtypes = [
        _p, _p, ctypes.c_int, _i64, _i64, _i64, _i64, *strides, *strides, _p, _p]
    library.kvmemo_flash_attention_packed.restype = ctypes.c_int
    library.kvmemo_flash_attention_packed.argtypes = [
        _p, _p, _p, ctypes.c_int, _i64, _i64, _i64, _i64, _i64, *strides, ctypes.c_float, _p, _p]
    return library


def _kernel() -> Callable[..., int] | None:
    library = _library()
    return None if library is None else library.kvmemo_flash_attention


@dataclass(frozen=True)
class PackedKV:
    """Keys and values [B, H, L, D] in the kernel's tile layout (pack_kv's result)."""

    k: torch.Tensor  # uint8, kvmemo_flash_packed_bytes
    v: torch.Tensor
    shape: tuple[int, int, int, int]  # B, H, L, D
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.k.numel() + self.v.numel()


def _served(*tensors: torch.Tensor) -> bool:
    """CPU fp32/bf16 of one dtype, unit last stride, D a multiple of 64 (what the kernel reads)."""
    first = tensors[0]
    return (
        first.device.type == "cpu"
        and first.dtype in DTYPE_CODES
        and all(t.dtype == first.dtype and t.stride(-1) == 1 for t in tensors)
        and first.shape[-1] % 64 == 0
    )


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> PackedKV | None:
    """k, v [B, H, L, D] packed for flash_attention_packed, or None where the kernel cannot
    take them (use flash_attention then)."""
    library = _library()
    if library is None or k.shape != v.shape or k.shape[2] < 1 or not _served(k, v):
        return None
    batch, heads, keys, head_dim = k.shape
    code = DTYPE_CODES[k.dtype]
    nbytes = library.kvmemo_flash_packed_bytes(code, batch, heads, keys, head_dim)
    k_buf, v_buf = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    if library.kvmemo_flash_pack(
        k.data_ptr(), v.data_ptr(), code, batch, heads, keys, head_dim, *k.stride()[:3],
        *v.stride()[:3], k_buf.data_ptr(), v_buf.data_ptr(),
    ):
        return None
    return PackedKV(k_buf, v_buf, (batch, heads, keys, head_dim), k.dtype)


def flash_attention_packed(
    q: torch.Tensor, packed: PackedKV, scale: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """flash_attention(q, k, v, None, scale) for q [B, H, M, D] and the k, v `packed` holds:
    o [B, H, M, D] and lse [B, H, M], fp32; None where the kernel cannot run it."""
    library = _library()
    batch, heads, rows, head_dim = q.shape
    keys = packed.shape[2]
    if (
        library is None or not _served(q) or q.dtype != packed.dtype
        or (batch, heads, keys, head_dim) != packed.shape
    ):
        return None
    out = torch.empty(batch, heads, rows, head_dim, dtype=torch.float32)
    lse = torch.empty(batch, heads, rows, dtype=torch.float32)
    if library.kvmemo_flash_attention_packed(
        q.data_ptr(), packed.k.data_ptr(), packed.v.data_ptr(), DTYPE_CODES[q.dtype], batch,
        heads, rows, keys, head_dim, *q.stride()[:3], scale, out.data_ptr(), lse.data_ptr(),
    ):
        return None
    return out, lse


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
