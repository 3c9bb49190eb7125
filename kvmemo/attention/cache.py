"""The paged KV cache: one tensor per layer for K and for V, addressed by slot.

Invariant: layer l's keys live in k_caches[l] with shape [num_blocks, block_size, num_kv_heads,
head_dim]; slot = block_id * block_size + offset; K is stored already rotated (RoPE applied).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_TORCH_KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """'auto' follows the model dtype; other names map to their torch dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return _TORCH_KV_DTYPES[kv_cache_dtype]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class PagedKVCache:
    """Owns the K and V page tensors of every layer."""

    k_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> PagedKVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(k_caches=k, v_caches=v, block_size=block_size)

    @property
    def num_blocks(self) -> int:
        return self.k_caches[0].shape[0]

    def copy_block_prefixes(self, copies: list[tuple[int, int, int]]) -> None:
        """Partial reuse: copy the first num_tokens slots of src into dst, in the given order.

        Order matters: a later copy may overwrite a block an earlier one read from.
        """
        for src, dst, num_tokens in copies:
            for cache in (*self.k_caches, *self.v_caches):
                cache[dst, :num_tokens].copy_(cache[src, :num_tokens])


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K and V ([T, Hkv, D]) into their slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
