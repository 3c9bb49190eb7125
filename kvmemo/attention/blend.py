"""Attention-side pieces of KV blending: moving cached keys to new positions, and attending from
query rows at arbitrary positions.

Invariant: a key moved from position p to q equals the key computed at q to fp32 rounding. RoPE
rotates each pair of dimensions by position * frequency; rotating on by the delta q - p would
compose angles rounded differently from the table's angle at q (fl(p*f) + fl((q-p)*f) is not
fl(q*f): 1e-4 apart at position 2,000). So the move undoes the table's rotation at p (the
transpose of the same cos/sin: exact up to cos^2 + sin^2 = 1 in fp32), then applies the
table's rotation at q: the same numbers a fresh computation at q uses.
"""

from __future__ import annotations

import torch

from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.cascade import (
    attention_with_lse_upto,
    fold_query_groups,
    unfold_query_groups,
)
from kvmemo.model.layers import apply_rotary


def rerotate(
    k: torch.Tensor,  # [N, Hkv, D] keys with RoPE applied at their old positions
    old: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) [N, 1, D/2] at the old positions
    new: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) at the new positions
) -> torch.Tensor:
    """The keys moved to their new positions, computed in fp32, returned in k's dtype."""
    cos_old, sin_old = old
    unrotated = apply_rotary(k.float(), cos_old.float(), -sin_old.float())
    cos_new, sin_new = new
    return apply_rotary(unrotated, cos_new.float(), sin_new.float()).to(k.dtype)


def read_slots(
    kv_cache: PagedKVCache, layer: int, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s K and V at `slots` [N] (block id * block_size + offset): [N, Hkv, D] each."""
    out = []
    for pages in (kv_cache.k_pages[layer], kv_cache.v_pages[layer]):
        num_kv_heads, num_blocks, block_size, head_dim = pages.shape
        flat = pages.view(num_kv_heads, num_blocks * block_size, head_dim)
        out.append(flat.index_select(1, slots).transpose(0, 1))
    return out[0], out[1]


def attend_at_positions(
    q: torch.Tensor,  # [S, Hq, D], RoPE applied at `positions`
    k: torch.Tensor,  # [L, Hkv, D]: the sequence's keys at positions 0..L-1
    v: torch.Tensor,  # [L, Hkv, D]
    positions: torch.Tensor,  # int64 [S]: each query row sees keys 0..positions[i]
    scale: float,
) -> torch.Tensor:
    """Causal attention for query rows scattered over a sequence: [S, Hq, D] in q's dtype."""
    num_rows = q.shape[0]
    num_kv_heads = k.shape[1]
    group = q.shape[1] // num_kv_heads
    folded = fold_query_groups(q.contiguous(), num_kv_heads)  # [1, Hkv, G * S, D]
    keys = k.permute(1, 0, 2).contiguous()[None]  # [1, Hkv, L, D]
    values = v.permute(1, 0, 2).contiguous()[None]
    out, _ = attention_with_lse_upto(folded, keys, values, positions.repeat(group), scale)
    return unfold_query_groups(out.to(q.dtype), num_rows)
