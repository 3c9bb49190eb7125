"""Greedy tokens from the lm_head without its full fp32 product: a bf16 product, then an exact
fp32 check of the few tokens that can still win (kernels/greedy_head.c, loaded by
kernels/greedy_head.py).

Invariant: `GreedyHead(w)(x)[r]` is argmax_j of the fp32 dot(x[r], w[j]) (the smallest j on a
tie), the token the fp32 head's argmax gives up to its own summation order, or -1 for a row the
caller must compute in full (a non-finite logit). Why it is exact: token j's bf16 logit differs
from its fp32 one by at most delta * |x| * |w_j| (Cauchy-Schwarz over the rounding of x, w and
the output to bf16 plus fp32 accumulation), so the best fp32 logit is at least L = max_k
(bf16_k - delta |x| |w_k|), and only tokens with bf16_j + delta |x| |w_j| >= L can hold it;
those are recomputed in fp32 and the best taken. The per-token norms matter: with the largest
norm for every token the window held ~560 tokens on average in W1, with each token's own ~7.
Why: a decode step of 32 sequences spent 4.7 ms of its ~33 in SmolLM2's fp32 head, reading its
113 MB of weights; the bf16 copy is half of that (2.5 ms) and the check about 7 rows of 576
per sequence. Costs a bf16 copy of the head (57 MB for SmolLM2). CPU only, where the bf16
product runs in hardware (avx512_bf16 or AMX; the few-row GEMM of skinny_linear.py, else
oneDNN), and only where the head's plain fp32 weight is held (tied to the embedding table, or
not released after packing).
The same bf16 copy gives the bf16 mode's temperature-sampled rows their logits (bf16_logits):
an approximation there, as in any bf16 engine, not the exact argmax above.
"""

from __future__ import annotations

import os

import torch

from kvmemo.model.kernels import skinny_linear
from kvmemo.model.kernels.greedy_head import refine_argmax_kernel
from kvmemo.model.layers.linear import KernelChoice, Linear, kernel_usable, onednn_available
from kvmemo.native import cpu_has_bf16_products


def relative_error_bound(dim: int) -> float:
    """delta: |bf16 logit - fp32 dot| <= delta * sum_i |x_i w_i|. bf16 keeps 8 significant bits,
    so rounding to it costs a relative 2^-8 at most: x and w (2 * 2^-8 per product, plus their
    product 2^-16), the output (2^-8), and fp32 accumulation over dim terms (about dim * 2^-24)
    in the bf16 product and again in the fp32 dot it is compared with; 2^-14 covers the
    second-order terms and 3 * dim * 2^-24 both accumulations with slack. (Denormal inputs,
    which the bf16 dot products flush, are not covered: hidden states of ~1e-38.)"""
    return 3 * 2.0**-8 + 2.0**-14 + 3 * dim * 2.0**-24


class GreedyHead:
    """The bf16 copy of one fp32 head weight [V, D] and the bound that makes its argmax exact."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().contiguous()  # fp32, read in place by the check
        bf16 = self.weight.to(torch.bfloat16)
        # One bf16 copy: the few-row GEMM's panels where it builds (2.1-2.4 ms for 32 rows x
        # SmolLM2's 49,152 x 576 head against oneDNN's 2.6, Zen 5), else oneDNN's packed copy.
        self._panels: skinny_linear.PackedWeight | None = None
        self._linear: Linear | None = None
        if kernel_usable("skinny", torch.bfloat16, self.weight.device):
            self._panels = skinny_linear.pack(bf16)
        else:
            self._linear = Linear(bf16, None, KernelChoice("onednn", "onednn"))
            self._linear.release_plain()  # oneDNN's packed copy is the only bf16 one kept
        del bf16
        self.row_norms = self.weight.norm(dim=1).contiguous()  # |w_j|, fp32 [V]
        # The bound's factor, widened by 2^-10 so that fp32 rounding in the kernel's own
        # comparisons (~2^-23 of the logits) cannot exclude the best token.
        self.delta = relative_error_bound(self.weight.shape[1]) * (1 + 2.0**-10)

    @staticmethod
    def available(weight: torch.Tensor) -> bool:
        """An fp32 CPU head on a CPU with bf16 products, a bf16 product to run it (the few-row
        GEMM or oneDNN) and the C check present (KVMEMO_GREEDY_HEAD=0 turns it off)."""
        return (
            os.environ.get("KVMEMO_GREEDY_HEAD", "1") != "0"
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and weight.dim() == 2
            and cpu_has_bf16_products()
            and (kernel_usable("skinny", torch.bfloat16, weight.device)
                 or onednn_available(torch.bfloat16))
            and refine_argmax_kernel() is not None
        )

    @property
    def nbytes(self) -> int:
        if self._panels is not None:
            return self._panels.nbytes
        assert self._linear is not None
        return self._linear.packed_bytes

    def coarse(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] bf16 -> the bf16 head's logits [N, V] bf16 (fp32 sums, rounded once)."""
        if self._panels is None:
            assert self._linear is not None
            return self._linear(x)
        return skinny_linear.linear(x, self._panels)

    def bf16_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> fp32 logits [N, V] of the bf16 product (bf16 inputs and weights,
        fp32 sums, never rounded to bf16 where the few-row GEMM runs): the head a bf16 engine
        samples from, at half the fp32 head's weight bytes and twice its arithmetic rate."""
        x = hidden.to(torch.bfloat16)
        if self._panels is None:
            return self.coarse(x).float()
        return skinny_linear.linear(x, self._panels, out_dtype=torch.float32)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> int64 [N] token ids, -1 where the row needs the full head."""
        kernel = refine_argmax_kernel()
        assert kernel is not None
        x = hidden.float().contiguous()
        coarse = self.coarse(x.to(torch.bfloat16))  # [N, V] bf16
        assert coarse.dtype == torch.bfloat16 and coarse.stride(1) == 1
        radii = (x.norm(dim=1) * self.delta).contiguous()  # a non-finite one: the row is -1
        out = torch.empty(x.shape[0], dtype=torch.int64)
        kernel(coarse.data_ptr(), x.shape[0], coarse.shape[1], coarse.stride(0), x.data_ptr(),
               x.shape[1], self.weight.data_ptr(), self.row_norms.data_ptr(), radii.data_ptr(),
               out.data_ptr())
        return out
