"""NativeLinear: a projection over GGUF weights kept at their own bits, with the Linear interface.

Invariant: one numeric path per weight, whatever the row count: quantized parts go through the
int8 kernel (x rounded to int8 per 16 values, quant_int8.py states the bound against F.linear),
F16/BF16 parts through the fp32-activation kernel, and both compute each output row from that
row alone (the same vectors summed in the same order in a call of 1 row or 1,000). So a token's
projections do not depend on the batch it is in, the chunk its prompt was cut into or whether
its prefix came from the cache: batch invariance. Why not a GEMM on a dequantized copy for
prefill, as before: oneDNN and MKL pick kernels (and summation orders) by row count, so the
same prompt answered alone, batched or from the cache could get other tokens; and the copies
cost up to a gigabyte. The price is prefill speed (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmemo.model.kernels import quant_int8
from kvmemo.model.kernels.quant_linear import QuantizedWeight, quant_linear


class NativeLinear:
    """A weight made of one or more row blocks (a fused q/k/v or gate/up may mix GGUF types),
    each quantized or dense fp32.

    Consecutive quantized parts run as one int8-kernel call on their GGUF bytes (x quantized
    once, one parallel loop over all their rows); F16/BF16 parts run the fp32-activation
    kernel, each writing its columns; a part the file stores in F32 goes through F.linear (no
    bundled model has one; its rows are invariant only as far as torch's GEMM is).
    """

    __slots__ = ("parts", "bias", "num_out", "_plan")

    def __init__(self, parts: list[QuantizedWeight | torch.Tensor], bias: torch.Tensor | None):
        self.parts = parts
        self.bias = None if bias is None else bias.detach()
        self.num_out = sum(p.shape[0] for p in parts)
        self._plan = _kernel_plan(parts)

    packed_bytes = 0
    packed_only = False

    @property
    def nbytes(self) -> int:
        """Bytes held: the parts at their bits."""
        return sum(p.nbytes if isinstance(p, QuantizedWeight) else p.numel() * p.element_size()
                   for p in self.parts)

    def dense(self) -> torch.Tensor:
        """The whole weight [N, K] in fp32 (dequantized now)."""
        return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p.float()
                          for p in self.parts])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self._product(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*shape[:-1], self.num_out)

    def single_int8_call(self) -> quant_int8.Int8Weights | None:
        """The Int8Weights that is the whole product, when it is one call."""
        if len(self._plan) == 1 and isinstance(self._plan[0][0], quant_int8.Int8Weights):
            return self._plan[0][0]
        return None

    def _product(self, x2: torch.Tensor) -> torch.Tensor:
        x32 = x2.float().contiguous()
        single = self.single_int8_call()
        if single is not None:
            return single(x32)  # every part in one kernel call (the common case)
        out = torch.empty(x2.shape[0], self.num_out, dtype=torch.float32)
        for step, start, end in self._plan:
            if isinstance(step, quant_int8.Int8Weights):
                step(x32, out[:, start:end])
            elif isinstance(step, QuantizedWeight):
                quant_linear(x32, step, out[:, start:end])
            else:
                out[:, start:end] = F.linear(x32, step.float())
        return out


_Step = quant_int8.Int8Weights | QuantizedWeight | torch.Tensor


def _kernel_plan(parts: list[QuantizedWeight | torch.Tensor]) -> list[tuple[_Step, int, int]]:
    """The parts as kernel calls with their output columns: runs of parts the int8 kernel reads
    become one call each; F16/BF16 parts go to the fp32-activation kernel, dense ones to
    F.linear."""
    plan: list[tuple[_Step, int, int]] = []
    run: list[QuantizedWeight] = []
    start = column = 0
    for part in parts:
        if isinstance(part, QuantizedWeight) and quant_int8.reads(part) and (
            len(run) < quant_int8.MAX_PARTS
        ):
            if not run:
                start = column
            run.append(part)
        else:
            if run:
                plan.append((quant_int8.Int8Weights(run), start, column))
                run = []
            plan.append((part, column, column + part.shape[0]))
        column += part.shape[0]
    if run:
        plan.append((quant_int8.Int8Weights(run), start, column))
    return plan
