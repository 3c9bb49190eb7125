"""Helpers for attention tests: random paged batches and a dense, obviously correct attention."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvmemo.attention.cache import FP8_DTYPE, PagedKVCache, dequantize_fp8, quantize_fp8
from kvmemo.attention.fp8 import scales_from_amax
from kvmemo.attention.metadata import AttentionMetadata

HEAD_DIM = 16


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Lq, Hq, D], the last Lq of Lk positions; k, v: [Lk, Hkv, D]. Repeats K/V per group."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@dataclass
class Batch:
    cache: PagedKVCache
    metadata: AttentionMetadata
    q: torch.Tensor  # [T, Hq, D]
    new_k: torch.Tensor  # [T, Hkv, D], this step's keys (not yet written)
    new_v: torch.Tensor
    full_k: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], full precision
    full_v: list[torch.Tensor]

    def stored(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """What the cache holds for x [L, Hkv, D], as real values (dequantised)."""
        dtype = self.cache.dtype
        if dtype == FP8_DTYPE:
            transform = self.cache.fp8_transform(0, which)
            return dequantize_fp8(quantize_fp8(x, transform), transform, torch.float32)
        return x.to(dtype).float()

    def expected(self, scale: float, dequantised: bool = True) -> torch.Tensor:
        """Dense attention per sequence over the stored (or full-precision) K/V. [T, Hq, D]."""
        md, outs = self.metadata, []
        for s in range(md.num_seqs):
            start, end = md.query_start_loc[s], md.query_start_loc[s + 1]
            k, v = self.full_k[s], self.full_v[s]
            if dequantised:
                k, v = self.stored(k, "k"), self.stored(v, "v")
            outs.append(dense_attention(self.q[start:end], k, v, scale))
        return torch.cat(outs)


def make_batch(
    *,
    cached: list[int],
    new: list[int],
    group: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    num_kv_heads: int = 2,
    seed: int = 0,
    head_dim: int = HEAD_DIM,
) -> Batch:
    """Sequences with `cached` tokens already in shuffled pages and `new` tokens to write now."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads = num_kv_heads * group
    num_blocks = sum(-(-(c + n) // block_size) for c, n in zip(cached, new)) + 3
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=num_blocks, block_size=block_size,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device="cpu")
    full_k = [torch.randn(c + n, num_kv_heads, head_dim) * (1 + torch.arange(num_kv_heads))[:, None]
              for c, n in zip(cached, new)]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim) for c, n in zip(cached, new)]
    if cache.is_fp8:  # scales from the data's per-head maximum, as calibration would
        k_amax = torch.stack([k.abs().amax(dim=(0, 2)) for k in full_k]).amax(0)
        v_amax = torch.stack([v.abs().amax(dim=(0, 2)) for v in full_v]).amax(0)
        cache.set_scales(scales_from_amax(k_amax)[None], scales_from_amax(v_amax)[None])
    free = list(range(num_blocks))
    rng.shuffle(free)  # block tables are not contiguous
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in zip(cached, new)]
    for table, c, k, v in zip(tables, cached, full_k, full_v):
        if c:  # the cached prefix is already in the pages, written through the real write path
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c)])
            cache.write(0, k[:c], v[:c], slots)
    md = AttentionMetadata.build(block_tables=tables, num_computed_tokens=cached, query_lens=new,
                                 block_size=block_size, num_cache_blocks=num_blocks)
    return Batch(
        cache=cache,
        metadata=md,
        q=torch.randn(sum(new), num_heads, head_dim),
        new_k=torch.cat([k[c:] for k, c in zip(full_k, cached)]),
        new_v=torch.cat([v[c:] for v, c in zip(full_v, cached)]),
        full_k=full_k,
        full_v=full_v,
    )
