"""A decode step's shared prefix, packed for the flash kernel once and read by every later step.

Invariant: an entry is returned only for the layer, page tensor, dtype and prefix block ids it was
packed from, with every one of those blocks at the allocation generation it had then
(BlockPool.generations). A block's KV changes only after the pool hands it out again, which bumps
its generation; a cascade prefix holds only full blocks that every sequence of its group has
computed, which nothing writes while they are held. So an entry is the prefix's current K/V.
Why: packing the prefix into the kernel's tiles was a third of each prefix call in a decode step
(84 of 249 us per layer at 96 rows x 1,024 keys in fp32), and the served benchmark's two
prefixes, whose blocks are not consecutive, were also gathered every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvmemo.attention.kernels.flash_attention import PackedKV

# Packed prefixes kept at most (K and V, all layers): 4,096 prefix tokens of SmolLM2 in fp32.
MAX_BYTES = 192 * 2**20

PrefixKey = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]


@dataclass
class PrefixPacks:
    """Packed prefixes by (layer, PrefixKey); the backend keeps one across steps."""

    generations: Sequence[int] | None = None  # the block pool's; None: nothing is kept
    max_bytes: int = MAX_BYTES
    _entries: dict[tuple[int, PrefixKey], PackedKV] = field(default_factory=dict)
    _bytes: int = 0

    def key(self, pages: torch.Tensor, dtype: torch.dtype,
            block_ids: list[int]) -> PrefixKey | None:
        """The identity of a prefix's K/V now, or None when generations are not known."""
        if self.generations is None:
            return None
        generations = self.generations
        return (pages.data_ptr(), dtype, tuple(block_ids), tuple(generations[b] for b in block_ids))

    def retain(self, keys: set[PrefixKey]) -> None:
        """Drops every entry whose prefix is not among this step's."""
        for entry_key in [k for k in self._entries if k[1] not in keys]:
            self._bytes -= self._entries.pop(entry_key).nbytes

    def get(self, layer: int, key: PrefixKey) -> PackedKV | None:
        return self._entries.get((layer, key))

    def put(self, layer: int, key: PrefixKey, packed: PackedKV) -> None:
        """Keeps `packed` unless that would pass max_bytes (then it serves this call only)."""
        if (layer, key) in self._entries or self._bytes + packed.nbytes > self.max_bytes:
            return
        self._entries[(layer, key)] = packed
        self._bytes += packed.nbytes

    @property
    def nbytes(self) -> int:
        return self._bytes
