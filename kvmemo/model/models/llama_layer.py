"""DecoderLayer: one Llama-family decoder layer (llama, mistral, qwen2; gemma3 subclasses it)
over one flattened token batch: norm, fused qkv, RoPE, the injected attention callable, o proj,
residual, norm, gated MLP, residual. The model (llama.py) stacks them.
"""

from __future__ import annotations

import torch
from torch import nn

from kvmemo.model.config import ModelArchConfig
from kvmemo.model.layers.basic import (
    AttentionFn,
    FastLayerStep,
    GatedMLP,
    RMSNorm,
    apply_rotary,
)
from kvmemo.model.layers.linear import KernelChoice, Linear


class DecoderLayer(nn.Module):
    """One pre-norm block: h += o_proj(attn(rope(qkv(norm(h))))); h += mlp(norm(h))."""

    def __init__(self, config: ModelArchConfig, norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        o_bias = config.attention_bias and config.architecture != "qwen2"
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)

    def prepare_linears(self, choice: KernelChoice) -> None:
        self.qkv = Linear(self.qkv_proj.weight, self.qkv_proj.bias, choice)
        self.o = Linear(self.o_proj.weight, self.o_proj.bias, choice)
        self.mlp.prepare_linears(choice)

    def linear_weights(self) -> list[torch.Tensor]:
        return [self.qkv_proj.weight, self.o_proj.weight, *self.mlp.linear_weights()]

    # Native weights' layer step in two kernel calls (llama_fast.FusedLayerStep), bound from
    # outside when it fits.
    fused_step: FastLayerStep | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The projections' (and attention's) dtype: their weights'. The residual stream
        `hidden` is fp32 in every mode."""
        return self.qkv_proj.weight.dtype

    def forward(
        self,
        layer_idx: int,
        hidden: torch.Tensor,  # [T, hidden] fp32
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        if self.fused_step is not None:
            return self.fused_step(layer_idx, hidden, cos, sin, attention)
        out = self.attention_block(layer_idx, self.normed_input(hidden), cos, sin, attention)
        return self.finish_block(hidden, out)

    def normed_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The attention block's input: input_layernorm(hidden), in the compute dtype."""
        return self.input_layernorm(hidden).to(self.compute_dtype)

    def finish_block(self, hidden: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
        """The layer after attention: the residual add of o_proj's output [T, hidden], then the
        MLP's (both adds in fp32). A blended prefill (engine/blend_forward.py) calls it for a
        subset of rows."""
        hidden = hidden + attention_out  # [T, hidden] fp32
        return hidden + self.mlp(self.post_attention_layernorm(hidden).to(self.compute_dtype))

    def attention_block(
        self,
        layer_idx: int,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        """o_proj(attention(rope(q), rope(k), v)) of the normed hidden states [T, hidden]."""
        q, k, v = self.project_qkv(normed, cos, sin)
        out = attention(layer_idx, q, k, v)  # [T, H, D]
        return self.o(out.reshape(normed.shape[0], self.q_size))

    def project_qkv(
        self, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, KV, D] with RoPE applied (after per-head norms, if any), and
        v [T, KV, D], of the normed hidden states [T, hidden]."""
        num_tokens = normed.shape[0]
        qkv = self.qkv(normed)  # [T, (H + 2*KV) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        if type(self).qk_norm is not DecoderLayer.qk_norm:  # per-head norms first (Gemma)
            q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KV, D]
            q, k = self.qk_norm(q, k)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        else:
            # q and k are adjacent columns of qkv: one RoPE pass over both heads' sets (the same
            # elementwise arithmetic, half the ops per layer; they cost more than their work in
            # a decode step).
            heads = self.num_heads + self.num_kv_heads
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads, self.head_dim)
            qk = apply_rotary(qk, cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, KV, D]
        return q, k, v

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head norms of q and k before RoPE: none in a Llama (Gemma overrides)."""
        return q, k
