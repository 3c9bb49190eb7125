"""Boundary checks every attention backend runs on a step: metadata against the cache, tensors
against the metadata. Each raises ValueError naming what does not fit."""

from __future__ import annotations

import torch

from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.metadata import AttentionMetadata


def check_metadata_fits_cache(metadata: AttentionMetadata, kv_cache: PagedKVCache) -> None:
    """Raises ValueError when the metadata was built for another pool or block size."""
    if metadata.block_size != kv_cache.block_size:
        raise ValueError(
            f"metadata block_size {metadata.block_size} "
            f"!= KV cache block_size {kv_cache.block_size}"
        )
    if metadata.num_cache_blocks != kv_cache.num_blocks:
        raise ValueError(
            f"metadata was validated against {metadata.num_cache_blocks} blocks (num_cache_blocks) "
            f"but the KV cache has {kv_cache.num_blocks}: its block ids may lie outside the cache"
        )


def check_step_tensors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: PagedKVCache,
    metadata: AttentionMetadata,
) -> None:
    """Raises ValueError when q/k/v do not hold one row per token of the metadata."""
    num_tokens = metadata.num_tokens
    if q.shape[0] != num_tokens or k.shape[0] != num_tokens or v.shape[0] != num_tokens:
        raise ValueError(
            f"q, k, v must have one row per token of the step ({num_tokens}, from query_lens), "
            f"got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
        )
    num_kv_heads = kv_cache.num_kv_heads
    if k.shape[1] != num_kv_heads or q.shape[1] % num_kv_heads:
        raise ValueError(
            f"k must have the cache's {num_kv_heads} kv heads and q a multiple of them, "
            f"got k {tuple(k.shape)}, q {tuple(q.shape)}"
        )
