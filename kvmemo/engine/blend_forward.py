"""Blended prefill: a prompt whose chunk segments' KV comes from the chunk cache, with only the
tokens whose KV deviates most recomputed (CacheBlend's selective recompute).

One sequence, whole uncached prompt, in one call:
1. Layers before the check layer run over every uncached token, as a plain prefill over the
   cached prefix: their KV is fresh everywhere.
2. The check layer projects q/k/v for every token (its K/V is written fresh for all) and
   compares each reused token's fresh K/V with its chunk's (keys moved to the new position):
   the squared difference is its deviation. (Layer 0's K/V depend on the token and position
   only, so they never deviate: the check layer must be 1 or later to see the new context.)
3. Every later layer gets the reused tokens' chunk KV, keys moved to their new positions.
4. The rows that continue: every token no chunk covers (the question, the context's uncached
   tail, chunk tails no longer cached) plus the top recompute_ratio of the reused tokens by
   deviation. From the check layer's attention on, they attend causally over the blended KV
   and overwrite their own slots with fresh KV; the other rows' work stops at step 2.

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
from kvmemo.attention.blend import (
    attend_at_positions,
    move_kv,
    read_slots,
    rerotate,
    sequence_kv,
)
from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.engine.scheduler_output import ScheduledSequence

# Rows per piece of the layers before the check layer: the engine's default step budget. Past
# ~2,700 rows SmolLM2's MLP intermediate outgrows glibc's 32 MiB mmap threshold and every
# layer page-faults it in afresh (layer 0 over 2,900 rows took 85-290 ms in one piece).
_PIECE_ROWS = 2048


@dataclass(frozen=True)
class BlendResult:
    # [S, hidden]: the final-normed recomputed rows, in position order; the last is the prompt's
    # last position (the one that samples). Benchmarks read the others' logits (teacher forcing).
    hidden: torch.Tensor
    positions: torch.Tensor  # [S] their positions
    num_reused_tokens: int  # KV taken from chunks as is (the other uncached tokens: computed)


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
    layers = model.layers
    check = min(max(seq.blend.check_layer, 0), len(layers) - 1)

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

    num_blocks = -(-end // size)
    block_ids = torch.tensor(seq.block_table[:num_blocks], dtype=torch.int64)
    all_positions = torch.arange(end, dtype=torch.int64)
    all_slots = _slots(seq.block_table, all_positions, size)
    positions = all_positions[start:]
    ids = torch.tensor(seq.token_ids, dtype=torch.int64, device=device)
    hidden = model.embed(ids)  # [T, hidden] fp32
    dtype = model.compute_dtype
    rope = model.rope_tables(positions.to(device), dtype)
    old_rope = model.rope_tables(src_pos.to(device), torch.float32)
    new_rope = model.rope_tables(reused_pos.to(device), torch.float32)
    src_slots_d = src_slots.to(device)
    dst_slots_d = all_slots[reused_pos].to(device)

    # 1. Layers before the check layer: every uncached token, as a prefill in pieces of at most
    # _PIECE_ROWS rows (a chunked prefill: each piece attends over the pieces before it).
    pieces = []
    for lo in range(0, num_new, _PIECE_ROWS):
        hi = min(lo + _PIECE_ROWS, num_new)
        metadata = AttentionMetadata.build(
            block_tables=[seq.block_table],
            num_computed_tokens=[start + lo],
            query_lens=[hi - lo],
            block_size=size,
            num_cache_blocks=kv_cache.num_blocks,
            device=device,
        )

        def full_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            return backend.forward(layer, q, k, v, kv_cache, metadata)  # noqa: B023 (used now)

        piece = hidden[lo:hi]
        for layer in range(check):
            cos, sin = rope[layer]
            piece = layers[layer](layer, piece, cos[lo:hi], sin[lo:hi], full_attention)
        pieces.append(piece)
    hidden = torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    # 2. The check layer's q/k/v for every token: fresh K/V for all of them, and each reused
    # token's deviation from its chunk's K/V.
    block = layers[check]
    cos, sin = rope[check]
    q, k, v = block.project_qkv(block.normed_input(hidden), cos, sin)
    num_reused = int(reused_rows.numel())
    picked = reused_rows[:0]
    if num_reused:
        k_old, v_old = read_slots(kv_cache, check, src_slots_d)
        k_old = rerotate(k_old, old_rope[check], new_rope[check])
        rows_d = reused_rows.to(device)
        fresh_k = k.index_select(0, rows_d).transpose(0, 1).float()  # [Hkv, N, D]
        fresh_v = v.index_select(0, rows_d).transpose(0, 1).float()
        deviation = (fresh_k - k_old.float()).square().sum((0, 2))
        deviation += (fresh_v - v_old.float()).square().sum((0, 2))
        num_pick = min(num_reused, math.ceil(seq.blend.recompute_ratio * num_reused - 1e-9))
        if num_pick:
            picked = reused_rows[torch.topk(deviation.cpu(), num_pick).indices]
    kv_cache.write(check, k, v, all_slots[start:].to(device))
    # 3. Later layers get the chunks' K/V at the new positions.
    for layer in range(check + 1, len(layers)):
        if num_reused:
            move_kv(kv_cache, layer, src_slots_d, dst_slots_d, old_rope[layer], new_rope[layer])

    # 4. The picked and uncovered tokens continue, attending over the blended K/V.
    rows = torch.sort(torch.cat([fresh_rows, picked])).values
    rows_d = rows.to(device)
    sel_positions = positions[rows].to(device)
    sel_slots = all_slots[start:][rows].to(device)
    block_ids_d = block_ids.to(device)

    def sparse_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if layer != check:  # the check layer's K/V are all written already
            kv_cache.write(layer, k, v, sel_slots)  # first: each row sees its own fresh key
        keys, values = sequence_kv(kv_cache, layer, block_ids_d)
        return attend_at_positions(q, keys, values, sel_positions, scale)

    out = sparse_attention(check, q.index_select(0, rows_d), k, v)
    attention_out = block.o(out.reshape(rows.numel(), -1))
    hidden = block.finish_block(hidden.index_select(0, rows_d), attention_out)
    sel_rope = model.rope_tables(sel_positions, dtype)
    for layer in range(check + 1, len(layers)):
        cos, sin = sel_rope[layer]
        hidden = layers[layer](layer, hidden, cos, sin, sparse_attention)
    return BlendResult(
        hidden=model.norm(hidden),
        positions=sel_positions,
        num_reused_tokens=num_new - int(rows.numel()),
    )
