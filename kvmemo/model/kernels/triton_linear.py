"""x @ W^T (+ b) in Triton, batch-invariant: the GPU's linear layers (and Triton's interpreter's).

Why not cuBLAS: cuBLAS picks its GEMM kernel, tiling and split-K by the row count, so a token's
activations change in their last bits with the batch around it, with the prefix cache (a cached
prompt computes fewer rows) and with a CUDA graph bucket's padding rows; on an H100 caching on
and off gave the same tokens with logprobs differing at 1e-7. Here every launch uses one tiling
per weight: an output element is the same loop over K in BLOCK_K steps accumulated in fp32,
whatever M is. Rows of a tile never mix (padding rows load zeros and are not stored), and M is
not specialised on (do_not_specialize), so a row's bits depend on its own activations only.

Under TRITON_INTERPRET=1 the kernel runs on CPU tensors in NumPy (how `make test` checks it);
there the product is `interpreted_dot` (fp32, rows summed alike on any CPU: kvmemo/triton_dot.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton_support.triton_unavailable_reason says why nothing here runs
    triton = None
    tl = None

from kvmemo.triton_dot import interpreted_dot
from kvmemo.triton_support import TRITON_DTYPES, interpreting

INTERPRETING = interpreting()  # fixed at import, as Triton fixes it when kernels are defined


@dataclass(frozen=True)
class Tiling:
    """One weight's launch shape: fixed for the weight's life, never chosen by the row count."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiling(n: int, dtype: torch.dtype, device: torch.device) -> Tiling:
    """The tiling of a weight of n rows: small tiles under the interpreter (seconds per test); on a
    GPU 64-row tiles for the tensor cores, and 32 columns where the weight is narrow so a
    decode step's few rows still spread over the multiprocessors."""
    if device.type != "cuda":
        return Tiling(16, 64, 32, 1, 1)
    if dtype == torch.float32:  # FMA products (input_precision="ieee"): smaller tiles
        return Tiling(32, 32 if n <= 4096 else 64, 32, 4, 2)
    return Tiling(64, 32 if n <= 4096 else 64, 64, 4, 3)


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
        stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, FP32: tl.constexpr, INTERPRETED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + cols[None, :] * stride_wn + kk[:, None],
                        mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BK, BN]
            if INTERPRETED:
                acc += interpreted_dot(x, w)
            elif FP32:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype (fp32 sums).

    Raises:
        ValueError: mismatched dtypes or shapes, or a dtype outside TRITON_DTYPES.
    """
    if triton is None:
        raise RuntimeError("triton is not installed (pip install triton)")
    if x.dtype != weight.dtype or x.dtype not in TRITON_DTYPES:
        raise ValueError(f"triton linear takes x and weight of one dtype among {TRITON_DTYPES}; "
                         f"got {x.dtype} and {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"triton linear takes x [M, K] and weight [N, K]; got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    shape = tiling(n, weight.dtype, weight.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, shape.block_m), triton.cdiv(n, shape.block_n))
    _linear_kernel[grid](
        x, weight, bias if bias is not None else x, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, FP32=x.dtype == torch.float32, INTERPRETED=INTERPRETING,
        BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, BLOCK_K=shape.block_k,
        num_warps=shape.num_warps, num_stages=shape.num_stages,
    )
    return out
