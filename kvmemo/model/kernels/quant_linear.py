"""GGUF-quantized weights kept at their own bits: products and row lookups read them in place.

Invariant: w.rows(ids) equals gguf-py's dequantize of those rows exactly, and quant_linear(x, w)
equals F.linear(x, w.dequantize()) to fp32 rounding, for every supported type
(kernels/quant_linear.c). The bytes are a view of the GGUF file's memory map, so a weight costs
its file size in page cache (shared, evictable) and no copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvmemo.native import load_library

SOURCE = Path(__file__).with_name("quant_linear.c")
T = GGMLQuantizationType
# The types the kernel reads (its enum holds the same GGML type numbers).
NATIVE_TYPES = frozenset(
    {T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K}
)

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class _Library:
    linear: Callable[..., int]
    rows: Callable[..., int]


@cache
def _library() -> _Library | None:
    library = load_library(SOURCE, "quantized weights are dequantized at load instead")
    if library is None:
        return None
    linear = library.kvmemo_quant_linear
    linear.restype = ctypes.c_int
    linear.argtypes = [_p, _p, ctypes.c_int, _p, _i64, _i64, _i64, _i64]
    rows = library.kvmemo_quant_rows
    rows.restype = ctypes.c_int
    rows.argtypes = [_p, ctypes.c_int, _p, _i64, _i64, _p]
    return _Library(linear, rows)


def native_kernel_available() -> bool:
    return _library() is not None


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A [num_rows, num_cols] weight as GGUF blocks: `data` holds num_rows rows of bytes."""

    name: str  # the tensor's name, for errors
    qtype: GGMLQuantizationType
    data: torch.Tensor  # uint8 [num_rows, row_bytes], contiguous (a view of the mapped file)
    num_cols: int
    # data is a view of a file mapped read-only: its pages are the file's, so a kernel that
    # keeps its own copy may drop them from the process (quant_int8.repacked)
    file_mapped: bool = False

    def __post_init__(self) -> None:
        if self.qtype not in NATIVE_TYPES:
            raise ValueError(
                f"tensor {self.name!r} has type {self.qtype.name}, which the native kernels do "
                f"not read; supported: {', '.join(sorted(t.name for t in NATIVE_TYPES))}"
            )
        values, size = GGML_QUANT_SIZES[self.qtype]
        if self.num_cols % values or self.data.shape[1] != self.num_cols // values * size:
            raise ValueError(
                f"tensor {self.name!r}: {self.data.shape[1]} bytes per row do not hold "
                f"{self.num_cols} {self.qtype.name} values"
            )
        if self.data.dtype != torch.uint8 or not self.data.is_contiguous():
            raise ValueError(f"tensor {self.name!r}: data must be contiguous uint8 rows")

    @classmethod
    def from_numpy(cls, name: str, qtype: GGMLQuantizationType, raw: np.ndarray) -> QuantizedWeight:
        """raw: the tensor's bytes as GGUF stores them, [num_rows, row_bytes] uint8 (a memmap
        view is kept, not copied; torch warns that it is read-only, which it is to us too)."""
        values, size = GGML_QUANT_SIZES[qtype]
        raw = raw if raw.dtype == np.uint8 else np.ascontiguousarray(raw).view(np.uint8)
        rows = raw.reshape(raw.shape[0] if raw.ndim > 1 else 1, -1)
        rows = np.ascontiguousarray(rows)
        with _quiet_readonly():
            data = torch.from_numpy(rows)
        return cls(name, qtype, data, rows.shape[1] // size * values, _read_only_map(rows))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.num_cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [len(ids), num_cols] of the given rows (all rows when ids is None)."""
        lib = _require()
        ids64 = None if ids is None else ids.to(torch.int64).contiguous()
        num_rows = self.data.shape[0]
        num = num_rows if ids64 is None else ids64.numel()
        if ids64 is not None and num and not 0 <= int(ids64.min()) <= int(ids64.max()) < num_rows:
            raise IndexError(f"row ids outside [0, {num_rows}) for {self.name!r}")
        out = torch.empty(num, self.num_cols, dtype=torch.float32)
        status = lib.rows(
            self.data.data_ptr(), int(self.qtype), None if ids64 is None else ids64.data_ptr(),
            num, self.num_cols, out.data_ptr(),
        )
        assert status == 0, f"quant_rows status {status}"
        return out

    def dequantize(self) -> torch.Tensor:
        return self.rows(None)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x [M, K] fp32 @ dequant(weight)[N, K]^T -> [M, N] fp32 (or into `out`, [M, >= N] with
    unit column stride, e.g. a column slice of a fused output)."""
    lib = _require()
    if x.dim() != 2 or x.shape[1] != weight.num_cols:
        raise ValueError(
            f"x must be [M, {weight.num_cols}] for {weight.name!r}, got {tuple(x.shape)}"
        )
    x32 = x.to(torch.float32).contiguous()
    num_rows, num_out = x32.shape[0], weight.data.shape[0]
    if out is None:
        out = torch.empty(num_rows, num_out, dtype=torch.float32)
    if out.dtype != torch.float32 or out.stride(1) != 1 or out.shape != (num_rows, num_out):
        raise ValueError("out must be fp32 [M, N] with unit column stride")
    status = lib.linear(
        x32.data_ptr(), weight.data.data_ptr(), int(weight.qtype), out.data_ptr(),
        num_rows, num_out, weight.num_cols, out.stride(0),
    )
    assert status == 0, f"quant_linear status {status}"
    return out


def dequantize_rows_into(data: np.ndarray, qtype: GGMLQuantizationType, out: torch.Tensor
                         ) -> bool:
    """GGUF rows `data` (uint8 [rows, bytes per row]) of a NATIVE_TYPES weight -> `out` (fp32,
    contiguous, [rows, values per row]) by the kernel, the same values gguf-py's dequantize
    gives (this file's invariant), in a fraction of its time: loading the dense mode spent
    0.6 s of its 1.4 s in gguf-py's NumPy. False, with nothing written, where the kernel is
    not built here or the type is not one it reads."""
    lib = _library()
    if lib is None or qtype not in NATIVE_TYPES or not out.is_contiguous():
        return False
    rows = np.ascontiguousarray(data.reshape(-1, data.shape[-1]))
    num_cols = out.numel() // max(1, rows.shape[0])
    values, block_bytes = GGML_QUANT_SIZES[qtype]
    if (out.numel() != rows.shape[0] * num_cols or num_cols % values
            or num_cols // values * block_bytes != rows.shape[1]):
        raise ValueError(f"dequantize_rows_into: {tuple(data.shape)} bytes of {qtype.name} do not "
                         f"fill an output of {tuple(out.shape)} values")
    status = lib.rows(rows.ctypes.data, int(qtype), None, rows.shape[0], num_cols,
                      out.data_ptr())
    assert status == 0, f"quant_rows status {status}"
    return True


def _require() -> _Library:
    lib = _library()
    if lib is None:
        raise RuntimeError(
            "the quantized-weight kernel could not be built (no C compiler?); "
            "load the model with weights='fp32' or 'bf16'"
        )
    return lib


@contextlib.contextmanager
def _quiet_readonly() -> Iterator[None]:
    """torch.from_numpy on a read-only memmap warns once per call; the weights are never
    written, so the warning says nothing here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        yield


def _read_only_map(array: np.ndarray) -> bool:
    """`array` is a view of a file mapped read-only: an mmap.mmap opened with ACCESS_READ (the
    GGUF reader's) or a np.memmap in mode "r"; not a copy, not a writable or copy-on-write map."""
    base: Any = array
    while base is not None:
        if isinstance(base, np.memmap):
            return base.mode == "r"
        if isinstance(base, memoryview):  # np.frombuffer's base
            return base.readonly and isinstance(base.obj, mmap.mmap)
        base = getattr(base, "base", None)
    return False
