"""NativeLinear: a projection over GGUF weights kept at their own bits, with the Linear interface.

Invariant: equals F.linear(x, dequantized weight) (+ bias), to fp32 rounding for F16/BF16/dense
parts and wherever a GEMM runs (more than MAX_KERNEL_ROWS rows, or DENSE_FROM_ROWS and more with
a dense copy), and with x rounded to int8 per 4 values for quantized parts on the kernels
(quant_int8.py states that bound). So the numerics depend on how many rows a step has. Why the
split: a decode step (a few rows) is bound by reading every weight, which the kernels do in place; a
prefill chunk (hundreds of rows) is bound by arithmetic, where oneDNN's GEMM on a dequantized
copy is several times faster than any few-row kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmemo.model.kernels import quant_int8
from kvmemo.model.kernels.quant_linear import QuantizedWeight, quant_linear
from kvmemo.model.layers.linear import onednn_available, onednn_matmul

# The kernels up to this many rows, dequantize + oneDNN above: a 32-row decode batch ran faster
# in the kernel (dequantizing Gemma's 262k-row head every step cost more).
MAX_KERNEL_ROWS = 32
# With a dense copy at hand, oneDNN on it from this many rows on: SmolLM2's weights, Zen 5, 2
# threads, int8 kernel against oneDNN fp32 (ms per pass): 8 rows 11.4 / 15.6, 16 rows 22.2 /
# 19.2, 32 rows 43.9 / 28.4.
DENSE_FROM_ROWS = 13


@dataclass
class DenseCopies:
    """Dense copies of native weights for batched steps, made on a weight's first such step
    while their fp32 bytes stay within `budget` (first come first served; the rest stay on the
    kernels or dequantize per call). Batched: a decode step of DENSE_FROM_ROWS to
    MAX_KERNEL_ROWS rows, or a step of several sequences. A single sequence's prefill uses a
    copy that exists and otherwise dequantizes per call, so a single-user chat never makes
    one; a batching server pays at most the budget."""

    budget: int
    used: int = 0
    sequences: int = 1  # in the step now running (the model runner sets it)

    def reserve(self, nbytes: int) -> bool:
        if self.used + nbytes > self.budget:
            return False
        self.used += nbytes
        return True


class NativeLinear:
    """A weight made of one or more row blocks (a fused q/k/v or gate/up may mix GGUF types),
    each quantized or dense fp32.

    Up to MAX_KERNEL_ROWS rows (decode batches, logits): consecutive quantized parts run as one
    int8-kernel call on their GGUF bytes (x quantized once, one parallel loop over all their
    rows); F16/BF16 parts run the fp32-activation kernel, each writing its columns. More rows
    (prefill) multiply with oneDNN on a dense copy if one was made (DenseCopies), else on the
    parts dequantized for that call.
    """

    __slots__ = ("parts", "bias", "num_out", "_plan", "copies", "_dense", "_refused")

    def __init__(self, parts: list[QuantizedWeight | torch.Tensor], bias: torch.Tensor | None,
                 copies: DenseCopies | None = None):
        self.parts = parts
        self.bias = None if bias is None else bias.detach()
        self.num_out = sum(p.shape[0] for p in parts)
        self._plan = _few_row_plan(parts)
        self.copies = copies
        self._dense: torch.Tensor | None = None  # oneDNN-packed (or plain) dense copy
        self._refused = False  # the budget had no room for this weight's copy

    def kernel_serves(self, rows: int) -> bool:
        """The few-row kernels take `rows` (else a GEMM on a dense weight does)."""
        if rows > MAX_KERNEL_ROWS:
            return False
        return rows < DENSE_FROM_ROWS or not self._may_copy()

    def _may_copy(self) -> bool:
        """A dense copy exists, or the budget has room for one."""
        if self._dense is not None:
            return True
        copies = self.copies
        return copies is not None and not self._refused and (
            copies.used + self.dense_bytes <= copies.budget)

    @property
    def dense_bytes(self) -> int:
        """Bytes of this weight's fp32 dense copy."""
        return self.num_out * (self.parts[0].shape[1]) * 4

    packed_bytes = 0
    packed_only = False

    @property
    def nbytes(self) -> int:
        """Bytes held: the parts at their bits, and the dense copy once made."""
        held = 0 if self._dense is None else self._dense_nbytes()
        return held + sum(p.nbytes if isinstance(p, QuantizedWeight)
                          else p.numel() * p.element_size() for p in self.parts)

    def _dense_nbytes(self) -> int:
        assert self._dense is not None
        return self.num_out * self.parts[0].shape[1] * self._dense.element_size()

    def dense(self) -> torch.Tensor:
        """The whole weight [N, K] in fp32 (dequantized now)."""
        return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p.float()
                          for p in self.parts])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kernel_serves(x2.shape[0]):
            out = self._few_rows(x2)
        else:
            out = self._gemm(x2)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*shape[:-1], self.num_out)

    def single_int8_call(self) -> quant_int8.Int8Weights | None:
        """The Int8Weights that is the whole few-row product, when it is one call."""
        if len(self._plan) == 1 and isinstance(self._plan[0][0], quant_int8.Int8Weights):
            return self._plan[0][0]
        return None

    def _gemm(self, x2: torch.Tensor) -> torch.Tensor:
        dtype = x2.dtype if x2.dtype in (torch.float32, torch.bfloat16) else torch.float32
        onednn = onednn_available(dtype) and x2.device.type == "cpu"
        weight = self._dense_copy(dtype, onednn, x2.shape[0])
        if weight is None:  # no copy kept: dequantize for this call only
            weight = self.dense().to(dtype)
        if onednn:
            # oneDNN: 3.9 ms where MKL took 8.7 for 1,024 x 576 x 1,536 fp32 on Zen 5. A plain
            # weight it reorders itself each call; the kept copy is reordered once.
            return onednn_matmul(x2.to(dtype).contiguous(), weight, None).float()
        return F.linear(x2.to(dtype), weight).float()

    def _dense_copy(self, dtype: torch.dtype, onednn: bool, rows: int) -> torch.Tensor | None:
        """The kept dense copy in `dtype`; made now for a batched step (see DenseCopies) if
        the budget has room; else None."""
        if self._dense is not None and self._dense.dtype == dtype:
            return self._dense
        copies = self.copies
        if copies is None or self._refused or (rows > MAX_KERNEL_ROWS and copies.sequences < 2):
            return None
        if self._dense is None and not copies.reserve(self.dense_bytes):
            self._refused = True
            return None
        plain = self.dense().to(dtype).contiguous()
        self._dense = torch.ops.mkldnn._reorder_linear_weight(plain) if onednn else plain
        return self._dense

    def _few_rows(self, x2: torch.Tensor) -> torch.Tensor:
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


def _few_row_plan(parts: list[QuantizedWeight | torch.Tensor]) -> list[tuple[_Step, int, int]]:
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
