"""EncoderCache: image features by content hash, least recently used first out, bounded by bytes.

Invariant: total_bytes <= capacity_bytes after every put; an entry larger than the whole
capacity is never stored (the caller keeps its own reference for the step that needs it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class EncoderCacheStats:
    num_encoded_images: int = 0  # images the vision encoder ran on (the metric tests count)
    num_encoder_calls: int = 0  # batched encoder forwards
    num_hits: int = 0  # image lookups served from the cache
    num_evicted: int = 0


class EncoderCache:
    """Owns the cached feature tensors; promises LRU eviction under a byte budget."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"encoder cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.total_bytes = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.stats = EncoderCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, content_hash: bytes) -> bool:
        return content_hash in self._entries

    def get(self, content_hash: bytes) -> torch.Tensor | None:
        """The features of an image, or None; a hit becomes the most recently used entry."""
        features = self._entries.get(content_hash)
        if features is not None:
            self._entries.move_to_end(content_hash)
            self.stats.num_hits += 1
        return features

    def put(self, content_hash: bytes, features: torch.Tensor) -> None:
        """Store features [num_image_tokens, hidden], evicting the least recently used first."""
        size = features.numel() * features.element_size()
        if content_hash in self._entries or size > self.capacity_bytes:
            return
        while self.total_bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.total_bytes -= evicted.numel() * evicted.element_size()
            self.stats.num_evicted += 1
        self._entries[content_hash] = features
        self.total_bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self.total_bytes = 0
