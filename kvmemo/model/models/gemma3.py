"""Gemma 3 text decoder: the Llama skeleton with Gemma's block shape and interleaved windows.

Differences from Llama, each HF's arithmetic (modeling_gemma3.py) in fp32: embeddings scaled
by sqrt(hidden); (1 + w) RMSNorms in fp32; RMSNorm over each q and k head before RoPE; norms
after attention and around the MLP; tanh-GELU gated MLP; a RoPE base per layer type (sliding
layers 10k, full layers the config's). Which layers slide is the attention
callable's business: the model only passes the layer index.
"""

from __future__ import annotations

import torch
from torch import nn

from kvmemo.model.config import SLIDING_ATTENTION, ModelArchConfig
from kvmemo.model.layers.basic import GemmaRMSNorm, RotaryEmbedding
from kvmemo.model.models.llama import LlamaForCausalLM
from kvmemo.model.models.llama_layer import DecoderLayer


class Gemma3DecoderLayer(DecoderLayer):
    """h += post_norm(o(attn(rope(qk_norm(qkv(norm(h))))))); h += post_ffw_norm(mlp(pre(h)))."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config, norm=GemmaRMSNorm)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.q_norm = GemmaRMSNorm(config.head_dim, eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)

    def finish_block(self, hidden: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(attention_out)  # fp32 stream
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden).to(self.compute_dtype))
        return hidden + self.post_feedforward_layernorm(mlp_out)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 (text): same loading, kernels and weight handling as LlamaForCausalLM."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        # Sliding layers rotate with their own base; full layers use self.rotary (rope_theta).
        self.local_rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_local_theta or config.rope_theta,
            None,
            config.max_position_embeddings,
        )
        self.sliding = [t == SLIDING_ATTENTION for t in (config.layer_types or ())]
        # HF keeps the scale as a 0-d fp32 tensor cast to the weights' dtype at use.
        self.embed_scale = torch.tensor(config.hidden_size**0.5, device="cpu")

    def make_layer(self, config: ModelArchConfig, index: int) -> nn.Module:
        return Gemma3DecoderLayer(config)

    def make_norm(self, hidden_size: int, eps: float) -> nn.Module:
        return GemmaRMSNorm(hidden_size, eps)

    def layer_weight_names(self, ours: str, hf: str) -> list[tuple[str, list[str]]]:
        return [
            (f"{ours}{name}.weight", [f"{hf}{prefix}{name}.weight"])
            for prefix, name in (
                ("self_attn.", "q_norm"),
                ("self_attn.", "k_norm"),
                ("", "pre_feedforward_layernorm"),
                ("", "post_feedforward_layernorm"),
            )
        ]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = super().embed(input_ids)
        return rows * self.embed_scale.to(rows.dtype)

    def rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        full = self.rotary.cos_sin(positions, dtype)  # each [T, 1, D/2]
        local = self.local_rotary.cos_sin(positions, dtype)
        return [local if sliding else full for sliding in self.sliding]
