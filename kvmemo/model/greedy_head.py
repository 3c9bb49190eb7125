"""Greedy tokens from the lm_head without its full fp32 product: a bf16 product, then an exact
fp32 check of the few tokens that can still win (kernels/greedy_head.c).

Invariant: `GreedyHead(w)(x)[r]` is argmax_j of the fp32 dot(x[r], w[j]) (the smallest j on a
tie), the token the fp32 head's argmax gives up to its own summation order, or -1 for a row the
caller must compute in full (a non-finite logit). Why it is exact: the bf16 product differs
from the fp32 one by at most MARGIN(x) = delta * |x| * max_j |w_j| (Cauchy-Schwarz over the
per-product rounding of x, w and the output to bf16 plus fp32 accumulation), so only tokens
whose bf16 logit lies within 2 * MARGIN of the bf16 maximum can hold the fp32 maximum; those are
recomputed in fp32 and the best taken.
Why: a decode step of 32 sequences spent 4.7 ms of its ~33 in SmolLM2's fp32 head, reading its
113 MB of weights; the bf16 copy is half of that (2.5 ms) and the check about 7 rows of 576
per sequence. Costs a bf16 copy of the head (57 MB for SmolLM2). CPU only, where the bf16
product runs in hardware (avx512_bf16 or AMX) through oneDNN.
"""

from __future__ import annotations

import ctypes
import math
import os
from functools import cache
from pathlib import Path
from typing import Callable

import torch

from kvmemo.model.linear_kernels import KernelChoice, Linear, onednn_available
from kvmemo.native import cpu_flags, load_library

SOURCE = Path(__file__).with_name("kernels") / "greedy_head.c"


@cache
def _kernel() -> Callable[..., None] | None:
    library = load_library(SOURCE, "greedy decoding reads the full fp32 head")
    if library is None:
        return None
    fn = library.kvmemo_refine_argmax
    fn.restype = None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, i64, i64, p, i64, p, p, p]
    return fn


def relative_error_bound(dim: int) -> float:
    """delta: |bf16 logit - fp32 logit| <= delta * sum_i |x_i w_i|. Rounding x and w to bf16
    (2^-9 each, 2^-18 their product), the output to bf16 (2^-9), and fp32 accumulation over dim
    terms in each product (dim * 2^-24 each), with a factor 2 of slack on the last."""
    return 2.0**-8 + 2.0**-9 + 2.0**-17 + 4 * dim * 2.0**-24


class GreedyHead:
    """The bf16 copy of one fp32 head weight [V, D] and the bound that makes its argmax exact."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().contiguous()  # fp32, read in place by the check
        self.coarse = Linear(self.weight.to(torch.bfloat16), None, KernelChoice("onednn", "onednn"))
        self.coarse.release_plain()  # oneDNN's packed copy is the only bf16 one kept
        self.max_row_norm = float(self.weight.norm(dim=1).max())
        self.delta = relative_error_bound(self.weight.shape[1])

    @staticmethod
    def available(weight: torch.Tensor) -> bool:
        """An fp32 CPU head on a CPU with bf16 products, oneDNN and the C kernel present
        (KVMEMO_GREEDY_HEAD=0 turns it off)."""
        return (
            os.environ.get("KVMEMO_GREEDY_HEAD", "1") != "0"
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and weight.dim() == 2
            and bool(set(cpu_flags().split()) & {"avx512_bf16", "amx_bf16"})
            and onednn_available(torch.bfloat16)
            and _kernel() is not None
        )

    @property
    def nbytes(self) -> int:
        return self.coarse.packed_bytes

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> int64 [N] token ids, -1 where the row needs the full head."""
        kernel = _kernel()
        assert kernel is not None
        x = hidden.float().contiguous()
        coarse = self.coarse(x.to(torch.bfloat16))  # [N, V] bf16
        assert coarse.dtype == torch.bfloat16 and coarse.stride(1) == 1
        margins = (x.norm(dim=1) * (self.delta * self.max_row_norm)).contiguous()
        if not math.isfinite(self.max_row_norm):
            margins.fill_(math.inf)  # every row -1: computed in full
        out = torch.empty(x.shape[0], dtype=torch.int64)
        kernel(coarse.data_ptr(), x.shape[0], coarse.shape[1], coarse.stride(0), x.data_ptr(),
               x.shape[1], self.weight.data_ptr(), margins.data_ptr(), out.data_ptr())
        return out
