"""Few-row linear layers (decode steps) through a C GEMM on weights packed into column panels.

Invariant: linear(x, pack(W), b) equals F.linear(x, W, b) to the dtype's rounding (fp32
accumulation, one rounding to bf16 for bf16), and unpack(pack(W)) is W exactly. The kernel runs
for CPU fp32 or bf16 [M, K] inputs of the packed weight's dtype (any M; it is the fastest choice
up to MAX_ROWS); any other input goes to F.linear on the unpacked weight. Why: a decode step
multiplies a few rows by every weight matrix, each read from DRAM once per step; the kernel
(kernels/skinny_linear.c) overlaps those reads with its arithmetic, where oneDNN's packed GEMM
left them exposed (SmolLM2's 150 products at 32 rows, weights from DRAM, Zen 5, 2 threads:
bf16 11.3 -> 8.0 ms, fp32 21.1 -> 16.5 ms).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from kvmemo.native import load_library

SOURCE = Path(__file__).with_name("skinny_linear.c")
# The decode class. Up to here the kernel beat oneDNN with weights from DRAM (Zen 5, 150 products:
# 64 rows fp32 28.3 vs 34.9 ms, bf16 14.4 vs 19.0; 128 rows 53.5 vs 59.2, 27.6 vs 32.0); from
# ~1,000 rows, where x no longer stays in L2 across a weight's panels, oneDNN is ahead.
MAX_ROWS = 128
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
BF16_IN_FP32_OUT = 2


@cache
def _library() -> ctypes.CDLL | None:
    library = load_library(SOURCE, "few-row linear layers use oneDNN or F.linear")
    if library is None:
        return None
    library.kvmemo_skinny_linear.restype = None
    library.kvmemo_skinny_linear.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    library.kvmemo_skinny_panel_cols.restype = ctypes.c_int
    return library


def kernel_available() -> bool:
    """The C kernel built and loaded on this machine."""
    return _library() is not None


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out_features, in_features] as the kernel reads it: panels of `panel_cols`
    output columns, each contiguous over k (bf16: k in pairs); zero-padded past the edges."""

    panels: torch.Tensor  # [num_panels, k steps, panel_cols (, 2 for bf16)]
    out_features: int
    in_features: int
    bias: torch.Tensor | None  # fp32 [out_features], added before rounding

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """Packs a CPU fp32 or bf16 weight [N, K] (the kernel must be available)."""
    library = _library()
    if library is None:
        raise RuntimeError("the few-row linear kernel is not built here (see kvmemo.native)")
    if weight.dim() != 2 or weight.dtype not in DTYPE_CODES or weight.device.type != "cpu":
        raise ValueError(f"pack takes a CPU fp32 or bf16 [N, K] weight, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    cols = library.kvmemo_skinny_panel_cols()
    n, k = weight.shape
    num_panels = -(-n // cols)
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    steps = -(-k // pair)
    padded = weight.detach()
    if (n, k) != (num_panels * cols, steps * pair):  # a copy only where there are edges
        padded = F.pad(padded, (0, steps * pair - k, 0, num_panels * cols - n))
    # One copy into the panel layout (a vocabulary's head is hundreds of MB: no extra pass).
    panels = torch.empty(num_panels, steps, cols, pair, dtype=weight.dtype)
    panels.permute(0, 2, 1, 3).copy_(padded.reshape(num_panels, cols, steps, pair))
    if pair == 1:
        panels = panels.squeeze(-1)
    bias32 = None if bias is None else bias.detach().float().contiguous()
    return PackedWeight(panels, n, k, bias32)


def unpack(packed: PackedWeight) -> torch.Tensor:
    """The plain weight [N, K], exactly."""
    panels = packed.panels if packed.panels.dim() == 4 else packed.panels.unsqueeze(-1)
    num_panels, steps, cols, pair = panels.shape
    plain = panels.permute(0, 2, 1, 3).reshape(num_panels * cols, steps * pair)
    return plain[: packed.out_features, : packed.in_features].contiguous()


def linear(
    x: torch.Tensor, packed: PackedWeight, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [M, K] @ W^T (+ the packed bias) -> [M, N] in x's dtype, or in fp32 for bf16 x with
    out_dtype=torch.float32 (the fp32 sums, never rounded to bf16)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype != x.dtype and (x.dtype, out_dtype) != (torch.bfloat16, torch.float32):
        raise ValueError(f"linear writes x's dtype, or fp32 for bf16 x; got {x.dtype} x and "
                         f"out_dtype {out_dtype}")
    library = _library()
    if (
        library is None
        or x.dim() != 2
        # Raw pointers: anything F.linear would reject (another device, a wrong K) must get
        # F.linear's error, never reach the kernel.
        or x.device.type != "cpu"
        or x.shape[1] != packed.in_features
        or x.dtype != packed.dtype
        # The kernel has no backward: leave products autograd needs to F.linear.
        or (torch.is_grad_enabled() and x.requires_grad)
    ):
        if out_dtype != x.dtype:  # x's bf16 values times the packed weight, summed in fp32
            return F.linear(x.float(), unpack(packed).float(), packed.bias)
        bias = None if packed.bias is None else packed.bias.to(packed.dtype)
        return F.linear(x, unpack(packed), bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], packed.out_features, dtype=out_dtype)
    bias_ptr = None if packed.bias is None else packed.bias.data_ptr()
    library.kvmemo_skinny_linear(
        x.data_ptr(), x.stride(0), packed.panels.data_ptr(), bias_ptr, out.data_ptr(),
        packed.out_features, x.shape[0], packed.out_features, packed.in_features,
        DTYPE_CODES[x.dtype] if out_dtype == x.dtype else BF16_IN_FP32_OUT)
    return out
