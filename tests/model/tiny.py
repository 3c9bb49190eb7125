"""Tiny random HF checkpoints and a caching attention fn shared by tests/model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmemo.model.layers.basic import AttentionFn

TINY_DIMS = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)


def tiny_hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer transformers model: "llama" (llama3 rope scaling) or "qwen2"."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(
            **TINY_DIMS, rope_theta=10000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False
        )
        model = LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(**TINY_DIMS, rope_theta=1e6, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(config)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomize so they are tested
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model.float().eval()


def caching_attention(scale: float | None = None) -> tuple[AttentionFn, dict[int, tuple]]:
    """One sequence whose K/V accumulate across calls; new queries sit at the end (causal)."""
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if layer_idx in cache:
            k = torch.cat([cache[layer_idx][0], k])  # [past + T, KV, D]
            v = torch.cat([cache[layer_idx][1], v])
        cache[layer_idx] = (k, v)
        num_new, num_total = q.shape[0], k.shape[0]
        # query i (absolute index past + i) may see keys 0..past + i
        mask = torch.ones(num_new, num_total, dtype=torch.bool).tril(num_total - num_new)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # [H|KV, T, D]
            attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        )  # [H, T, D]
        return out.transpose(0, 1)  # [T, H, D]

    return attention, cache
