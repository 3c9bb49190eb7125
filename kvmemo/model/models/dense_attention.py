"""Reference AttentionFn: the whole flattened batch is ONE sequence, attended causally with SDPA.

For tests and as a correctness oracle; it keeps no KV cache (every call sees only its own tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmemo.model.layers.basic import AttentionFn


def dense_causal_attention(
    num_heads: int, num_kv_heads: int, scale: float | None = None
) -> AttentionFn:
    """Return attention(layer_idx, q [T,H,D], k [T,KV,D], v [T,KV,D]) -> [T,H,D], causal over T."""
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    use_gqa = num_heads != num_kv_heads

    def attention(
        layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [H, T, D]
            k.transpose(0, 1),  # [KV, T, D]
            v.transpose(0, 1),  # [KV, T, D]
            is_causal=True,
            scale=scale,
            enable_gqa=use_gqa,
        )  # [H, T, D]
        return out.transpose(0, 1)  # [T, H, D]

    return attention
