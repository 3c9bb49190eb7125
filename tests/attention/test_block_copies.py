"""PagedKVCache.copy_block_prefixes (partial block reuse): the first n slots of src go to dst in
every layer's K and V pages, in order, whether the copies are chained or independent (batched)."""

from __future__ import annotations

import pytest
import torch

from kvmemo.attention.cache import FP8_DTYPE, PagedKVCache


def _cache(dtype: torch.dtype) -> PagedKVCache:
    cache = PagedKVCache.allocate(num_layers=3, num_blocks=12, block_size=8, num_kv_heads=2,
                                  head_dim=16, dtype=dtype, device="cpu")
    torch.manual_seed(0)
    for pages in cache.distinct_pages:
        pages.view(torch.uint8).copy_(torch.randint(0, 120, pages.view(torch.uint8).shape,
                                                    dtype=torch.uint8))
    return cache


def _reference(cache: PagedKVCache, copies: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """One block at a time, in order, on copies of the pages' bytes."""
    pages = [p.view(torch.uint8).clone() for p in cache.distinct_pages]
    for src, dst, n in copies:
        for p in pages:
            p[:, dst, :n] = p[:, src, :n].clone()
    return pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE], ids=str)
@pytest.mark.parametrize("copies", [
    [(1, 5, 3), (1, 6, 8), (2, 7, 1)],  # independent: one source, several new blocks
    [(1, 5, 3), (5, 6, 2), (6, 1, 8)],  # chained: a later copy reads an earlier one's block
    [(1, 5, 3), (2, 5, 6)],  # the same destination twice: the later copy wins where both write
    [(4, 9, 7)],
])
def test_copies_equal_one_block_at_a_time(dtype, copies) -> None:
    cache = _cache(dtype)
    expected = _reference(cache, copies)
    cache.copy_block_prefixes(copies)
    for got, want in zip(cache.distinct_pages, expected):
        assert torch.equal(got.view(torch.uint8), want)
