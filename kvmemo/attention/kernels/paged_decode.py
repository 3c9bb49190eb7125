"""The compiled CPU decode kernel (kernels/paged_decode.c), built and loaded by kvmemo.native.

Invariant: `load_decode_kernel()` returns a working kernel or None, never raises; None (no C
compiler, a failed build, KVMEMO_CPU_KERNEL=0) means callers use the torch gather + SDPA path,
which computes the same values.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kvmemo.attention.cache import FP8_DTYPE
from kvmemo.native import load_library

SOURCE = Path(__file__).with_name("paged_decode.c")
KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, FP8_DTYPE: 3}
MAX_HEAD_DIM, MAX_GROUP = 256, 32  # the C kernel's fixed tile buffers
IO_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # write_and_decode's q/k/v/out dtypes

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


@dataclass(frozen=True)
class DecodeKernel:
    """The loaded shared object and where it came from."""

    path: Path
    fn: Callable[..., int]  # the ctypes function pointer; returns a status code
    write_fn: Callable[..., int]  # kvmemo_paged_decode_write: the KV write folded in

    def supports(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
        """True when this kernel can run the shapes, dtypes and layout (else use the torch path)."""
        num_kv_heads, head_dim = k_pages.shape[0], k_pages.shape[-1]
        return (
            q.device.type == "cpu"
            and k_pages.device.type == "cpu"
            and k_pages.dtype in KV_DTYPE_CODES
            and v_pages.dtype == k_pages.dtype
            and k_pages.is_contiguous()
            and v_pages.is_contiguous()
            and head_dim <= MAX_HEAD_DIM
            and q.shape[1] % num_kv_heads == 0
            and q.shape[1] // num_kv_heads <= MAX_GROUP
        )

    def __call__(
        self,
        q: torch.Tensor,  # [B, Hq, D]
        k_pages: torch.Tensor,  # [Hkv, num_blocks, bs, D] contiguous
        v_pages: torch.Tensor,
        block_tables: torch.Tensor,  # [S, max_blocks] int64
        # [B] int64: the block_tables row of each query; None: row b
        table_rows: torch.Tensor | None,
        first_block: int,  # table entries to skip (a cascade suffix starts after the prefix)
        kv_lens: torch.Tensor,  # [B] int64 keys per sequence, counted from first_block
        scale: float,
        with_lse: bool = False,
        split: bool = True,
        # [B] int64: each query's first key, counted as kv_lens (a sliding window's); None: 0
        kv_starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention output [B, Hq, D] in q's dtype and, if asked, the fp32 log-sum-exp [B, Hq].
        split=False keeps each query's keys in one pass on one thread (batch-invariant: its
        output does not depend on how many queries share the call)."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads, num_blocks, block_size, _ = k_pages.shape
        if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
            raise ValueError(
                "the decode kernel reads pages [Hkv, num_blocks, bs, D] that are contiguous"
            )
        q32 = q.to(torch.float32).contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        rows = None if table_rows is None else table_rows.to(torch.int64).contiguous()
        lens = kv_lens.to(torch.int64).contiguous()
        out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
        lse = torch.empty(batch, num_heads, dtype=torch.float32) if with_lse else None
        status = self.fn(
            q32.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), KV_DTYPE_CODES[k_pages.dtype],
            tables.data_ptr(), tables.shape[1], None if rows is None else rows.data_ptr(),
            first_block, lens.data_ptr(), _starts_ptr(kv_starts, batch), batch, num_heads,
            num_kv_heads, head_dim, block_size, num_blocks, scale, out.data_ptr(),
            None if lse is None else lse.data_ptr(), int(split),
        )
        if status == 3:
            raise MemoryError("decode kernel: no memory for the split keys' partial results")
        if status != 0:
            raise ValueError(
                f"decode kernel cannot run head_dim {head_dim} with {num_heads} q / {num_kv_heads} "
                f"kv heads (head_dim <= {MAX_HEAD_DIM}, group <= {MAX_GROUP}); "
                "check supports() first"
            )
        return out.to(q.dtype), lse


    def write_and_decode(
        self,
        q: torch.Tensor,  # [B, Hq, D] fp32 or bf16, unit stride within a token's row
        k: torch.Tensor,  # [B, Hkv, D] q's dtype: this step's keys, one token per sequence
        v: torch.Tensor,  # [B, Hkv, D] q's dtype, the same strides as k
        slots: torch.Tensor,  # [B] int64: each token's slot in the pages
        k_pages: torch.Tensor,  # [Hkv, num_blocks, bs, D] contiguous, fp32 or bf16
        v_pages: torch.Tensor,
        block_tables: torch.Tensor,  # [S, max_blocks] int64 contiguous
        table_rows: torch.Tensor | None,  # [B] int64 contiguous, or None: row b
        kv_lens: torch.Tensor,  # [B] int64 contiguous: keys from first_block on, the new one too
        scale: float,
        first_block: int = 0,
        # A cascade's attention over the shared keys before first_block: o [B, Hq, D] and lse
        # [B, Hq], fp32 contiguous; the result is then attention over both, merged in place.
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
        split: bool = True,
        kv_starts: torch.Tensor | None = None,  # as __call__'s
    ) -> torch.Tensor:
        """Writes k/v into their slots, then attends as __call__ does: [B, Hq, D] in q's dtype.
        The caller has checked that write_fits()."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads, num_blocks, block_size, _ = k_pages.shape
        out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype)
        o_prefix, lse_prefix = prefix if prefix is not None else (None, None)
        status = self.write_fn(
            q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0),
            IO_DTYPE_CODES[q.dtype], slots.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(),
            KV_DTYPE_CODES[k_pages.dtype], block_tables.data_ptr(), block_tables.shape[1],
            None if table_rows is None else table_rows.data_ptr(), first_block,
            kv_lens.data_ptr(), _starts_ptr(kv_starts, batch), batch, num_heads, num_kv_heads,
            head_dim, block_size, num_blocks, scale,
            None if o_prefix is None else o_prefix.data_ptr(),
            None if lse_prefix is None else lse_prefix.data_ptr(), out.data_ptr(), int(split),
        )
        if status == 3:
            raise MemoryError("decode kernel: no memory for the split keys' partial results")
        if status != 0:
            raise ValueError(f"decode+write kernel status {status}: check write_fits() first")
        return out

    @staticmethod
    def write_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """q/k/v shaped and laid out as write_and_decode reads them (one dtype, fp32 or bf16,
        heads D apart, unit stride, D and the query group within the kernel's buffers)."""
        head_dim = q.shape[2]
        return (
            head_dim <= MAX_HEAD_DIM
            and q.shape[1] % k.shape[1] == 0
            and q.shape[1] // k.shape[1] <= MAX_GROUP
            and q.dtype == k.dtype == v.dtype and q.dtype in IO_DTYPE_CODES
            and q.stride(2) == k.stride(2) == v.stride(2) == 1
            and q.stride(1) == k.stride(1) == v.stride(1) == head_dim
            and k.stride(0) == v.stride(0)
        )


def _starts_ptr(kv_starts: torch.Tensor | None, batch: int) -> int | None:
    if kv_starts is None:
        return None
    if kv_starts.dtype != torch.int64 or not kv_starts.is_contiguous() or len(kv_starts) != batch:
        raise ValueError("kv_starts must be a contiguous int64 tensor with one entry per query")
    return kv_starts.data_ptr()


@cache
def load_decode_kernel() -> DecodeKernel | None:
    """The kernel for this machine (built on first use, then cached on disk), or None."""
    library = load_library(SOURCE, "CPU decode uses gather + SDPA")
    if library is None:
        return None
    fn = library.kvmemo_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [
        _p, _p, _p, ctypes.c_int, _p, _i64, _p, _i64, _p, _p,
        _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _p, _p, ctypes.c_int,
    ]
    write_fn = library.kvmemo_paged_decode_write
    write_fn.restype = ctypes.c_int
    write_fn.argtypes = [
        _p, _i64, _p, _p, _i64, ctypes.c_int, _p, _p, _p, ctypes.c_int, _p, _i64, _p, _i64, _p,
        _p, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _p, _p, _p, ctypes.c_int,
    ]
    return DecodeKernel(path=Path(library._name), fn=fn, write_fn=write_fn)
