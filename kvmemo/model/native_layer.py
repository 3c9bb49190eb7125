"""A Llama decoder layer's decode step over native GGUF weights: two int8-kernel calls around
the attention call.

Invariant: computes what DecoderLayer.forward computes with the same NativeLinears (the norms in
fp32, RoPE rotate-half, the residual adds, silu(gate) * up), only in another order of float
operations: each small op is folded into the int8 kernel call next to it (quant_int8.Fused).
Why: a one-token decode step on a 135M model spends as long in small tensor ops (norms, RoPE,
adds, the MLP's activation: about 20 torch calls per layer, each costing microseconds of
dispatch for nanoseconds of arithmetic) as in reading the weights. Only layers whose weights
are all int8-kernel types, without biases, per-head norms or a non-SiLU activation, in fp32,
take this path (fits), and only for steps every projection serves on the kernels (serves: up
to 12 rows, or 32 when no dense copy can be made); everything else runs DecoderLayer.forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from kvmemo.model.layers import RMSNorm
from kvmemo.model.native_linear import NativeLinear
from kvmemo.model.quant_int8 import Fused, Int8Weights, mlp_block

if TYPE_CHECKING:
    from kvmemo.model.llama import AttentionFn, DecoderLayer


class FusedDecodeStep:
    """norm -> q/k/v (+ RoPE) | attention | o_proj (+ residual) | norm -> gate/up | silu * up ->
    down (+ residual), for one DecoderLayer."""

    def __init__(self, layer: DecoderLayer) -> None:
        calls = [_single_call(lin) for lin in (layer.qkv, layer.o, layer.mlp.gate_up,
                                                 layer.mlp.down)]
        if any(call is None for call in calls):
            raise ValueError("FusedDecodeStep needs every projection in one int8 call (fits())")
        self.qkv, self.o, self.gate_up, self.down = cast("list[Int8Weights]", calls)
        norms = cast("list[RMSNorm]", [layer.input_layernorm, layer.post_attention_layernorm])
        self.input_norm: torch.Tensor = norms[0].weight.detach()
        self.mlp_norm: torch.Tensor = norms[1].weight.detach()
        self.input_eps, self.mlp_eps = float(norms[0].eps), float(norms[1].eps)
        self.linears = cast("list[NativeLinear]", [layer.qkv, layer.o, layer.mlp.gate_up,
                                                   layer.mlp.down])
        hidden = self.o.num_out  # the shapes the C block assumes, checked once here
        gate, up = (w.shape[0] for w in self.gate_up.weights)
        if not (gate == up == self.down.num_cols and self.gate_up.num_cols == hidden
                == self.down.num_out == self.qkv.num_cols == self.input_norm.numel()
                == self.mlp_norm.numel() and self.o.num_cols == layer.q_size):
            raise ValueError("FusedDecodeStep: the layer's projection shapes do not chain")
        self.input_norm, self.mlp_norm = self.input_norm.contiguous(), self.mlp_norm.contiguous()
        self.num_heads, self.num_kv_heads = layer.num_heads, layer.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = layer.head_dim, layer.q_size, layer.kv_size

    @staticmethod
    def fits(layer: DecoderLayer) -> bool:
        from kvmemo.model.llama import DecoderLayer

        mlp = layer.mlp
        linears = (getattr(layer, "qkv", None), getattr(layer, "o", None),
                   getattr(mlp, "gate_up", None), getattr(mlp, "down", None))
        return (
            type(layer) is DecoderLayer  # not a subclass with its own norms (Gemma)
            and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm
            and layer.input_layernorm.weight.dtype == torch.float32
            and layer.post_attention_layernorm.weight.dtype == torch.float32
            and mlp.activation == "silu"
            and all(_single_call(lin) is not None and lin.bias is None  # type: ignore[union-attr]
                    for lin in linears)
            and len(_single_call(mlp.gate_up).weights) == 2  # type: ignore[union-attr]
        )

    def serves(self, rows: int) -> bool:
        """Every projection takes `rows` on the kernels (batched steps with dense copies at hand
        go through DecoderLayer.forward's GEMMs instead)."""
        return all(linear.kernel_serves(rows) for linear in self.linears)

    def __call__(self, layer_idx: int, hidden: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        tokens = hidden.shape[0]
        half = self.head_dim // 2
        rope = (cos.reshape(tokens, half), sin.reshape(tokens, half),
                self.q_size + self.kv_size, self.head_dim)
        qkv = self.qkv(hidden, fused=Fused(norm=self.input_norm, eps=self.input_eps, rope=rope))
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = attention(layer_idx, q, k, v)  # [T, H, D]
        return mlp_block(out.reshape(tokens, self.q_size), hidden, self.o, self.mlp_norm,
                         self.mlp_eps, self.gate_up, self.down)


def _single_call(linear: object) -> Int8Weights | None:
    """The one int8-kernel call a NativeLinear's few-row product makes, if that is all it does."""
    if not isinstance(linear, NativeLinear):
        return None
    return linear.single_int8_call()

