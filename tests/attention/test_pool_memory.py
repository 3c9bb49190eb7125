"""The paged KV pool costs memory as its blocks fill, not at allocation (CPU): its pages come
zeroed from the OS on first touch, read as zeros before, and hold what is written."""

from __future__ import annotations

import pytest
import torch

from kvmemo.attention.cache import PagedKVCache


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_pool_pages_are_resident_only_once_written(dtype):
    before = resident_mib()
    cache = PagedKVCache.allocate(
        num_layers=8, num_blocks=2048, block_size=16, num_kv_heads=4, head_dim=64,
        dtype=dtype, device="cpu",
    )
    pool_mib = sum(p.numel() * p.element_size() for p in cache.k_pages + cache.v_pages) / 2**20
    assert pool_mib >= 64
    assert resident_mib() - before < pool_mib / 8  # allocated, not yet touched
    layer = cache.k_pages[0]  # [Hkv, num_blocks, bs, D]
    assert layer.is_contiguous() and not layer.any()  # reads as zeros
    block = torch.full((4, 1, 16, 64), 0.5).to(dtype)
    layer[:, 7:8] = block
    assert torch.equal(layer[:, 7:8].float(), block.float()) and not layer[:, 8:].any()
    touched = resident_mib() - before
    assert touched < pool_mib / 8  # one block written: a few pages, not the pool
