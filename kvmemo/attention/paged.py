"""Fast paged attention for a mixed batch: all decodes in one batched SDPA, prefills per sequence.

Invariant: equal (to float tolerance) to torch_ref.paged_attention_ref for every batch.
Grouped-query heads are folded into query rows ([Hkv, G * Lq, D]) so K/V are never repeated.
When every sequence starts with the same cached blocks (a shared system prompt), the batch goes
to cascade.py instead, which reads those blocks once rather than once per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmemo.attention.cascade import cascade_attention, cascade_prefix_blocks
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.attention.torch_ref import gather_sequence_kv


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D] rotated queries; K/V of this step already written. Returns [T, Hq, D]."""
    prefix_blocks = cascade_prefix_blocks(metadata)
    if prefix_blocks:
        return cascade_attention(q, k_cache, v_cache, metadata, prefix_blocks, scale)
    out = torch.empty_like(q)
    decode = [s for s, n in enumerate(metadata.query_lens) if n == 1]
    if len(decode) == metadata.num_seqs:
        out[:] = _batched_decode(q, k_cache, v_cache, metadata, decode, scale)
        return out
    if decode:
        rows = torch.tensor([metadata.query_start_loc[s] for s in decode], device=q.device)
        out[rows] = _batched_decode(q.index_select(0, rows), k_cache, v_cache, metadata, decode, scale)
    for s, query_len in enumerate(metadata.query_lens):
        if query_len == 1:
            continue
        start, end = metadata.query_start_loc[s], metadata.query_start_loc[s + 1]
        seq_len = metadata.seq_lens[s]
        k = gather_sequence_kv(k_cache, metadata.block_tables[s], seq_len).to(q.dtype)
        v = gather_sequence_kv(v_cache, metadata.block_tables[s], seq_len).to(q.dtype)
        out[start:end] = _prefill_one(q[start:end], k, v, scale)
    return out


def _batched_decode(
    q: torch.Tensor,  # [B, Hq, D], one query per decode sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    decode: list[int],
    scale: float,
) -> torch.Tensor:
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    batch, num_heads = q.shape[0], q.shape[1]
    group = num_heads // num_kv_heads
    seq_lens = [metadata.seq_lens[s] for s in decode]
    num_blocks = -(-max(seq_lens) // block_size)
    tables = metadata.block_tables if len(decode) == metadata.num_seqs else metadata.block_tables[decode]
    tables = tables[:, :num_blocks]  # [B, nb]
    # [B, nb, bs, Hkv, D] -> [B, Hkv, L, D]
    k = k_cache[tables].view(batch, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache[tables].view(batch, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    lens = metadata.seq_lens_t if len(decode) == metadata.num_seqs else metadata.seq_lens_t[decode]
    mask = torch.arange(num_blocks * block_size, device=q.device)[None, :] < lens[:, None]  # [B, L]
    qg = q.view(batch, num_kv_heads, group, head_dim)  # heads h*G..h*G+G-1 share kv head h
    o = F.scaled_dot_product_attention(
        qg, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale
    )  # [B, Hkv, G, D]
    return o.reshape(batch, num_heads, head_dim)


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Lq, Hq, D]; k, v: [Lk, Hkv, D] with the last Lq keys belonging to the queries."""
    query_len, num_heads, head_dim = q.shape
    seq_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    # [Lq, Hkv, G, D] -> [Hkv, G * Lq, D]: row r = g * Lq + i is query i of head h*G+g.
    qg = q.view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * query_len, head_dim)
    if query_len == seq_len:
        q_pos = torch.arange(query_len, device=q.device)
    else:
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [Lq, Lk]
    o = F.scaled_dot_product_attention(
        qg, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask.repeat(group, 1), scale=scale
    )  # [Hkv, G * Lq, D]
    return o.view(num_kv_heads, group, query_len, head_dim).permute(2, 0, 1, 3).reshape(query_len, num_heads, head_dim)
