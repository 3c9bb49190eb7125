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
from kvmemo.attention.lse_attention import (
    attention_with_lse_upto,
    fold_query_groups,
    unfold_query_groups,
)
from kvmemo.model.layers.basic import apply_rotary


def rerotate(
    k: torch.Tensor,  # [Hkv, N, D] keys with RoPE applied at their old positions
    old: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) [N, 1, D/2] at the old positions
    new: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) at the new positions
) -> torch.Tensor:
    """The keys moved to their new positions, computed in fp32, returned in k's dtype."""
    cos_old, sin_old = (t.float().transpose(0, 1) for t in old)  # [1, N, D/2]
    cos_new, sin_new = (t.float().transpose(0, 1) for t in new)
    unrotated = apply_rotary(k.float(), cos_old, -sin_old)
    return apply_rotary(unrotated, cos_new, sin_new).to(k.dtype)


def _flat(pages: torch.Tensor) -> torch.Tensor:
    """[Hkv, num_blocks, bs, D] pages as [Hkv, slots, D] (a view)."""
    num_kv_heads, num_blocks, block_size, head_dim = pages.shape
    return pages.view(num_kv_heads, num_blocks * block_size, head_dim)


def read_slots(
    kv_cache: PagedKVCache, layer: int, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s K and V at `slots` [N] (block id * block_size + offset): [Hkv, N, D]."""
    k = _flat(kv_cache.k_pages[layer]).index_select(1, slots)
    v = _flat(kv_cache.v_pages[layer]).index_select(1, slots)
    return k, v


def move_kv(
    kv_cache: PagedKVCache,
    layer: int,
    src_slots: torch.Tensor,  # [N]
    dst_slots: torch.Tensor,  # [N]
    old: tuple[torch.Tensor, torch.Tensor],  # RoPE (cos, sin) [N, 1, D/2] at the src positions
    new: tuple[torch.Tensor, torch.Tensor],  # at the dst positions
) -> None:
    """Copies one layer's K/V from src to dst slots, keys moved to their new positions.

    Source and destination are [Hkv, N, D] contiguous, so both index ops stream whole head
    rows (the transposed [N, Hkv, D] layout made this copy most of a blend's overhead).
    """
    k, v = read_slots(kv_cache, layer, src_slots)
    _flat(kv_cache.k_pages[layer]).index_copy_(1, dst_slots, rerotate(k, old, new))
    _flat(kv_cache.v_pages[layer]).index_copy_(1, dst_slots, v)


def sequence_kv(
    kv_cache: PagedKVCache, layer: int, block_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's K and V over its whole blocks, [Hkv, num_blocks * bs, D] each (position p
    at row p), gathered block by block."""
    k = kv_cache.k_pages[layer].index_select(1, block_ids)
    v = kv_cache.v_pages[layer].index_select(1, block_ids)
    return k.view(k.shape[0], -1, k.shape[-1]), v.view(v.shape[0], -1, v.shape[-1])


def attend_at_positions(
    q: torch.Tensor,  # [S, Hq, D], RoPE applied at `positions`
    k: torch.Tensor,  # [Hkv, L, D]: the sequence's keys, position p at row p
    v: torch.Tensor,  # [Hkv, L, D]
    positions: torch.Tensor,  # int64 [S]: each query row sees keys 0..positions[i]
    scale: float,
) -> torch.Tensor:
    """Causal attention for query rows scattered over a sequence: [S, Hq, D] in q's dtype."""
    num_rows = q.shape[0]
    num_kv_heads = k.shape[0]
    group = q.shape[1] // num_kv_heads
    folded = fold_query_groups(q.contiguous(), num_kv_heads)  # [1, Hkv, G * S, D]
    keys, values = k.to(q.dtype)[None], v.to(q.dtype)[None]  # [1, Hkv, L, D]
    out, _ = attention_with_lse_upto(folded, keys, values, positions.repeat(group), scale)
    return unfold_query_groups(out.to(q.dtype), num_rows)
