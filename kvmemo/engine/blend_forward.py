"""Blended prefill: a prompt whose chunk segments' KV comes from the chunk cache, with only the
tokens whose KV deviates most recomputed (CacheBlend's selective recompute).

One sequence, whole uncached prompt, in one call:
1. Layers 0..check run over every uncached token, as a plain prefill over the cached prefix:
   their KV is fresh everywhere. On the check layer, each reused token's fresh K/V is compared
   with its cached K/V (keys re-rotated to the new position): the squared difference is its
   deviation.
2. Every later layer gets the reused tokens' cached KV (keys moved to their new positions).
3. The rows that continue: every token no chunk covers (the question, the context's uncached
   tail, chunk tails no longer cached) plus the top recompute_ratio of the reused tokens by
   deviation. Through layers check+1.., they attend causally over the blended KV and overwrite
   their own slots with fresh KV.

Invariant: the last prompt position is always recomputed (no chunk covers the question), so the
returned hidden row is the one that samples the first token. recompute_ratio 1.0 recomputes
every token: a full prefill, computed in a different order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvmemo.attention.backend import AttentionBackend
from kvmemo.attention.blend import attend_at_positions, read_slots, rerotate
from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.engine.scheduler_output import ScheduledSequence


@dataclass(frozen=True)
class BlendResult:
    hidden: torch.Tensor  # [1, hidden]: the final-normed last position
    num_reused_tokens: int  # KV taken from chunks as is
    num_recomputed_tokens: int  # KV computed through every layer


def _slots(block_table: list[int | None], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    table = torch.tensor([b if b is not None else -1 for b in block_table], dtype=torch.int64)
    blocks = table[positions // block_size]
    if bool((blocks < 0).any()):
        raise ValueError("a blended sequence's block table has released blocks")
    return blocks * block_size + positions % block_size


def blend_prefill(
    model: Any,  # a Llama-family model: embed, rope_tables, layers, norm
    kv_cache: PagedKVCache,
    backend: AttentionBackend,
    seq: ScheduledSequence,
    *,
    scale: float,
    device: torch.device,
) -> BlendResult:
    assert seq.blend is not None
    size = kv_cache.block_size
    start = seq.num_computed_tokens
    num_new = len(seq.token_ids)
    end = start + num_new
    num_layers = len(model.layers)
    check = min(max(seq.blend.check_layer, 0), num_layers - 1)

    # Where reused tokens come from and go to (positions in the prompt and their slots).
    dst_pos_parts, src_pos_parts, src_slot_parts = [], [], []
    for source in seq.blend.sources:
        offsets = torch.arange(source.num_tokens, dtype=torch.int64)
        dst_pos_parts.append(source.dst_start + offsets)
        src_pos_parts.append(source.src_start + offsets)
        src_slot_parts.append(_slots(source.src_block_table, source.src_start + offsets, size))
    reused_pos = torch.cat(dst_pos_parts) if dst_pos_parts else torch.zeros(0, dtype=torch.int64)
    src_pos = torch.cat(src_pos_parts) if src_pos_parts else reused_pos
    src_slots = torch.cat(src_slot_parts) if src_slot_parts else reused_pos
    reused_rows = reused_pos - start  # rows of the step's tokens
    is_reused = torch.zeros(num_new, dtype=torch.bool)
    is_reused[reused_rows] = True
    fresh_rows = (~is_reused).nonzero()[:, 0]

    all_positions = torch.arange(end, dtype=torch.int64)
    all_slots = _slots(seq.block_table, all_positions, size)
    dst_slots = all_slots[reused_pos]
    positions = all_positions[start:]
    ids = torch.tensor(seq.token_ids, dtype=torch.int64, device=device)
    hidden = model.embed(ids)  # [T, hidden]
    dtype = hidden.dtype
    rope = model.rope_tables(positions.to(device), dtype)
    old_rope = model.rope_tables(src_pos.to(device), torch.float32)
    new_rope = model.rope_tables(reused_pos.to(device), torch.float32)
    src_slots_d, dst_slots_d = src_slots.to(device), dst_slots.to(device)

    def cached_kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The reused tokens' chunk K (re-rotated to their new positions) and V."""
        k, v = read_slots(kv_cache, layer, src_slots_d)
        return rerotate(k, old_rope[layer], new_rope[layer]), v

    metadata = AttentionMetadata.build(
        block_tables=[seq.block_table],
        num_computed_tokens=[start],
        query_lens=[num_new],
        block_size=size,
        num_cache_blocks=kv_cache.num_blocks,
        device=device,
    )
    deviation = torch.zeros(0)

    def full_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        nonlocal deviation
        if layer == check and reused_rows.numel():
            k_old, v_old = cached_kv(layer)
            rows = reused_rows.to(device)
            dk = (k.index_select(0, rows).float() - k_old.float()).square().sum((1, 2))
            dv = (v.index_select(0, rows).float() - v_old.float()).square().sum((1, 2))
            deviation = (dk + dv).cpu()
        return backend.forward(layer, q, k, v, kv_cache, metadata)

    for layer in range(check + 1):
        cos, sin = rope[layer]
        hidden = model.layers[layer](layer, hidden, cos, sin, full_attention)

    if reused_rows.numel():
        for layer in range(check + 1, num_layers):
            k_old, v_old = cached_kv(layer)
            kv_cache.write(layer, k_old, v_old, dst_slots_d)

    num_reused = int(reused_rows.numel())
    num_pick = min(num_reused, math.ceil(seq.blend.recompute_ratio * num_reused - 1e-9))
    picked = reused_rows[torch.topk(deviation, num_pick).indices] if num_pick else reused_rows[:0]
    rows = torch.sort(torch.cat([fresh_rows, picked])).values
    rows_d = rows.to(device)
    hidden = hidden.index_select(0, rows_d)
    sel_positions = positions[rows].to(device)
    sel_slots = all_slots[start:][rows].to(device)
    key_slots = all_slots.to(device)
    sel_rope = model.rope_tables(sel_positions, dtype)

    def sparse_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        kv_cache.write(layer, k, v, sel_slots)  # first: each row sees its own fresh key
        keys, values = read_slots(kv_cache, layer, key_slots)
        return attend_at_positions(q, keys.to(q.dtype), values.to(q.dtype), sel_positions, scale)

    for layer in range(check + 1, num_layers):
        cos, sin = sel_rope[layer]
        hidden = model.layers[layer](layer, hidden, cos, sin, sparse_attention)
    recomputed = int(rows.numel()) if check + 1 < num_layers else num_new
    return BlendResult(
        hidden=model.norm(hidden[-1:]),
        num_reused_tokens=num_new - recomputed,
        num_recomputed_tokens=recomputed,
    )
