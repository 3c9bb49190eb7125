"""The plain, obviously correct paged attention every faster backend is tested against.

Invariant: query i of a sequence (absolute position seq_len - query_len + i) attends exactly to
the sequence's cached positions 0..its own position (for a sliding-window layer, only the last
`sliding_window` of them), read through its block table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmemo.attention.metadata import AttentionMetadata


def gather_sequence_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """[num_blocks, block_size, H, D] pages -> this sequence's contiguous [seq_len, H, D]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    pages = cache.index_select(0, block_table[:num_blocks])  # [nb, bs, H, D]
    return pages.flatten(0, 1)[:seq_len]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention for a mixed prefill/decode batch, one sequence at a time.

    q: [T, Hq, D] (rotated). K/V of this step must already be written to the cache.
    Returns [T, Hq, D].
    """
    out = torch.empty_like(q)
    for s in range(metadata.num_seqs):
        start, end = metadata.query_start_loc[s], metadata.query_start_loc[s + 1]
        seq_len = metadata.seq_lens[s]
        query_len = end - start
        k = gather_sequence_kv(k_cache, metadata.block_tables[s], seq_len).to(q.dtype)
        v = gather_sequence_kv(v_cache, metadata.block_tables[s], seq_len).to(q.dtype)
        # Query i sits at absolute position (seq_len - query_len + i) and sees keys 0..that.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = key_pos <= q_pos[:, None]  # [Lq, Lk]
        if metadata.sliding_window is not None:  # and no further back than the window
            mask &= key_pos > q_pos[:, None] - metadata.sliding_window
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # [Hq, Lq, D]
            k.transpose(0, 1),  # [Hkv, Lk, D]
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o.transpose(0, 1)
    return out
