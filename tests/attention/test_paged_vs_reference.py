"""The fast paged backend and the reference equal dense causal attention over random batches."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvmemo.attention.cache import PagedKVCache, write_kv
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.attention.paged import paged_attention
from kvmemo.attention.torch_ref import paged_attention_ref

HEAD_DIM = 16


def dense_attention(q, k, v, scale):
    """q: [Lq, Hq, D] for the last Lq of Lk positions; k, v: [Lk, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def run_case(seed: int, group: int, block_size: int, num_kv_heads: int = 2) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads = num_kv_heads * group
    num_seqs = rng.randint(1, 5)
    cached = [rng.choice([0, 1, block_size - 1, block_size, 2 * block_size + 3, rng.randint(0, 4 * block_size)]) for _ in range(num_seqs)]
    new = [rng.choice([1, 1, rng.randint(1, 3 * block_size)]) for _ in range(num_seqs)]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in zip(cached, new)) + 3
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, dtype=torch.float32, device="cpu")
    free = list(range(num_blocks))
    rng.shuffle(free)  # block tables are not contiguous
    tables, full_k, full_v = [], [], []
    for c, n in zip(cached, new):
        table = [free.pop() for _ in range(-(-(c + n) // block_size))]
        tables.append(table)
        k = torch.randn(c + n, num_kv_heads, HEAD_DIM)
        v = torch.randn(c + n, num_kv_heads, HEAD_DIM)
        full_k.append(k)
        full_v.append(v)
        if c:  # the cached prefix is already in the pages
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c)])
            write_kv(cache.k_caches[0], cache.v_caches[0], k[:c], v[:c], slots)
    md = AttentionMetadata.build(block_tables=tables, num_computed_tokens=cached, query_lens=new, block_size=block_size, num_cache_blocks=num_blocks, request_ids=[f"r{i}" for i in range(num_seqs)])
    write_kv(cache.k_caches[0], cache.v_caches[0], torch.cat([k[c:] for k, c in zip(full_k, cached)]), torch.cat([v[c:] for v, c in zip(full_v, cached)]), md.slot_mapping)
    q = torch.randn(sum(new), num_heads, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    expected = torch.cat([dense_attention(q[md.query_start_loc[s]:md.query_start_loc[s + 1]], full_k[s], full_v[s], scale) for s in range(num_seqs)])
    for backend in (paged_attention_ref, paged_attention):
        got = backend(q, cache.k_caches[0], cache.v_caches[0], md, scale)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"{backend.__name__} cached={cached} new={new}")


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_backends_match_dense_on_random_batches(group, block_size):
    for seed in range(12):
        run_case(seed * 100 + group * 10 + block_size, group, block_size)


def test_all_decode_batch():
    # Force the pure-decode branch: every sequence has exactly one new token.
    for seed in range(5):
        rng = random.Random(seed)
        block_size = 16
        torch.manual_seed(seed)
        cached = [rng.randint(0, 70) for _ in range(6)]
        tables = []
        nxt = 0
        for c in cached:
            nb = -(-(c + 1) // block_size)
            tables.append(list(range(nxt, nxt + nb)))
            nxt += nb
        cache = PagedKVCache.allocate(num_layers=1, num_blocks=nxt, block_size=block_size, num_kv_heads=3, head_dim=HEAD_DIM, dtype=torch.float32, device="cpu")
        for kc in (cache.k_caches[0], cache.v_caches[0]):
            kc.normal_()
        md = AttentionMetadata.build(block_tables=tables, num_computed_tokens=cached, query_lens=[1] * 6, block_size=block_size, num_cache_blocks=nxt, request_ids=list("abcdef"))
        q = torch.randn(6, 9, HEAD_DIM)
        torch.testing.assert_close(
            paged_attention(q, cache.k_caches[0], cache.v_caches[0], md, 0.25),
            paged_attention_ref(q, cache.k_caches[0], cache.v_caches[0], md, 0.25), atol=1e-5, rtol=1e-5)


def test_metadata_rejects_inconsistent_input():
    with pytest.raises(ValueError, match="one block table, computed count and request id per sequence"):
        AttentionMetadata.build(block_tables=[[0]], num_computed_tokens=[0, 0], query_lens=[1, 1], block_size=16, num_cache_blocks=4, request_ids=["a"])
    with pytest.raises(ValueError, match="too short for a context of 20 tokens"):
        AttentionMetadata.build(block_tables=[[0]], num_computed_tokens=[10], query_lens=[10], block_size=16, num_cache_blocks=4, request_ids=["a"])
    with pytest.raises(ValueError, match=r"block id outside \[0, 4\)"):
        AttentionMetadata.build(block_tables=[[7]], num_computed_tokens=[0], query_lens=[3], block_size=16, num_cache_blocks=4, request_ids=["a"])
