"""The matrix product the Triton kernels take under Triton's interpreter, with each output its
own fixed-order sum.

Why: the interpreter runs `tl.dot` as NumPy's matmul, which goes to OpenBLAS, and OpenBLAS's AVX2
(Haswell) kernel sums a row differently by the row's place in the tile (seen on a Zen 3: 10 of
16 rows of a [16, 32] x [32, 64] product changed bits when moved to row 0). A kernel that is
batch-invariant on a GPU (a tensor-core product never mixes rows) then was not under the
interpreter on an AVX2 machine, and its tests failed there. A broadcast product reduced over K
treats every row alike on any CPU. Its bf16 operands are widened first: the interpreter's own
bf16 dot is wrong. GPU kernels keep `tl.dot`; only the interpreter's branch calls this.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # triton_support.triton_unavailable_reason says why nothing here runs
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def interpreted_dot(a, b):
        """a [M, K] . b [K, N] in fp32: output (m, n) sums a[m, k] * b[k, n] in the same order
        for every m, whatever the rows beside it."""
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
