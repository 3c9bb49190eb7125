"""Linear layers through the fastest kernel this machine has, per dtype and shape class.

Invariant: every kernel computes x @ W^T (+ b) to the dtype's rounding (only the summation order
differs), so the choice changes speed, never the product. Kernels:
- "torch": F.linear (MKL or OpenBLAS on CPU, cuBLAS on CUDA); every shape, every device.
- "onednn": oneDNN's matmul on a weight reordered once into its blocked layout (what vLLM's CPU
  backend calls). On AMD CPUs MKL takes a generic path: oneDNN ran fp32 2.1x faster at 2,048 rows
  and 3.6x at 32 (Zen 5, measured, see docs/benchmarks.md).
- "skinny": kvmemo's C GEMM for at most 128 rows (decode) on a weight packed once into column
  panels, its DRAM reads overlapping its arithmetic (fp32 and bf16; skinny_linear.py).
- "triton": a Triton GEMM with one tiling per weight (triton_linear.py), the GPU's: batch-
  invariant where cuBLAS is not (it picks its kernel by row count). Runs on CUDA, and on CPU
  only under Triton's interpreter (tests); never probed on a CPU.
A `Linear` holds one weight and the kernels chosen for its two shape classes: "decode" (at most
DECODE_ROWS rows: decode steps, logits) and "prefill" (more rows).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmemo import isa
from kvmemo.model.kernels import skinny_linear
from kvmemo.triton_support import TRITON_DTYPES, triton_unavailable_reason

logger = logging.getLogger(__name__)

KERNELS = ("torch", "onednn", "skinny", "triton")
CPU_KERNELS = ("torch", "onednn", "skinny")  # what a CPU probe times
PLAIN_READERS = frozenset({"torch", "triton"})  # the kernels that read the plain weight
DECODE_ROWS = skinny_linear.MAX_ROWS  # the few-row class: decode steps and logits


@dataclass(frozen=True)
class KernelChoice:
    """The kernel for each shape class."""

    decode: str = "torch"
    prefill: str = "torch"

    def __post_init__(self) -> None:
        for name in (self.decode, self.prefill):
            if name not in KERNELS:
                raise ValueError(f"linear kernel must be one of {list(KERNELS)}, got {name!r}")


# oneDNN takes bf16 weights only with AVX-512 (core: F, BW, VL, DQ) or AVX-NE-CONVERT; elsewhere
# torch's reorder raises ("bf16 path needs the cpu support ..."); bf16 runs emulated in F.linear.
_ONEDNN_BF16_FLAGS = (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
                      frozenset({"avx_ne_convert"}))


@functools.cache
def onednn_available(dtype: torch.dtype) -> bool:
    """oneDNN's CPU matmul exists in this torch build for `dtype` and runs on this CPU at the
    active instruction-set level: a kernel that raises here is never chosen (tried once)."""
    if not (
        dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if dtype == torch.bfloat16 and not any(f <= isa.cpu_flags() for f in _ONEDNN_BF16_FLAGS):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype))
        onednn_matmul(torch.ones(2, 8, dtype=dtype), packed, None)
    except RuntimeError as e:
        logger.info("oneDNN matmul unusable for %s here (%s): using F.linear", dtype, e)
        return False
    return True


def kernel_usable(name: str, dtype: torch.dtype, device: torch.device) -> bool:
    if name == "torch":
        return True
    if name == "triton":
        return dtype in TRITON_DTYPES and triton_unavailable_reason(device) is None
    if device.type != "cpu":
        return False
    if name == "onednn":
        return onednn_available(dtype)
    return dtype in skinny_linear.DTYPE_CODES and skinny_linear.kernel_available()


def onednn_matmul(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ W^T (+ b) by oneDNN; W packed by _reorder_linear_weight, or plain (it reorders it
    itself, each call)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear:
    """x [..., K] -> [..., N] by one weight [N, K] (+ bias), through the chosen kernels.

    Holds the packed copies its chosen kernels read (oneDNN's blocked layout, the skinny
    kernel's panels), made once, here. The weight must not change after construction: the packed
    copies would go stale. When no chosen kernel reads the plain weight it can be released
    (release_plain); dense() then rebuilds it exactly from a packed copy.
    """

    __slots__ = ("weight", "bias", "choice", "_packed", "_panels", "_dtype")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, choice: KernelChoice
    ) -> None:
        device, dtype = weight.device, weight.dtype
        # A kernel this weight cannot use (CUDA, fp16, no C compiler) falls back to torch.
        choice = KernelChoice(
            decode=choice.decode if kernel_usable(choice.decode, dtype, device) else "torch",
            prefill=choice.prefill if kernel_usable(choice.prefill, dtype, device) else "torch",
        )
        self.weight: torch.Tensor | None = weight.detach()
        self._dtype = weight.dtype
        self.bias = None if bias is None else bias.detach()
        self.choice = choice
        self._packed: torch.Tensor | None = None
        self._panels: skinny_linear.PackedWeight | None = None
        if "onednn" in (choice.decode, choice.prefill):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        if "skinny" in (choice.decode, choice.prefill):
            self._panels = skinny_linear.pack(weight, self.bias)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed copies (0 without one)."""
        total = 0 if self._panels is None else self._panels.nbytes
        if self._packed is not None:
            total += self._packed.numel() * self._packed.element_size()
        return total

    @property
    def packed_only(self) -> bool:
        """No chosen kernel reads the plain weight (each reads a packed copy)."""
        return not PLAIN_READERS & {self.choice.decode, self.choice.prefill}

    def release_plain(self) -> None:
        """Drops this object's reference to the plain weight (only when packed_only)."""
        if not self.packed_only:
            raise ValueError("the plain weight is read by a chosen kernel; it cannot be released")
        self.weight = None

    def dense(self) -> torch.Tensor:
        """The plain weight [N, K]: held, or rebuilt (exactly) from a packed copy."""
        if self.weight is not None:
            return self.weight
        if self._panels is not None:
            return skinny_linear.unpack(self._panels)
        assert self._packed is not None
        return self._packed.to_dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        kernel = self.choice.decode if rows <= DECODE_ROWS else self.choice.prefill
        if kernel == "onednn" and x.dtype == self._dtype:
            assert self._packed is not None
            return onednn_matmul(x, self._packed, self.bias)
        if kernel == "triton" and x.dtype == self._dtype:
            from kvmemo.model.kernels import triton_linear  # imports triton: only when chosen

            out = triton_linear.linear(x.reshape(rows, x.shape[-1]), self.dense(), self.bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if kernel == "skinny":
            assert self._panels is not None
            out = skinny_linear.linear(x.reshape(rows, x.shape[-1]), self._panels)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return F.linear(x, self.dense(), self.bias)
