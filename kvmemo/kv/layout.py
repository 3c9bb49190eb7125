"""KVLayout: how one engine lays out and names its KV blocks, built once and shared.

Invariant: every part that depends on block size, pool size, KV dtype or the namespace (the
hasher, the manager, the paged cache, the store connector) reads it from the one KVLayout the
engine built, so they cannot disagree. Torch-free: the dtype is its name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmemo.kv.hashing import BlockHash, RequestHasher, check_algorithm


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers that share one block table. A plain model has one group of every layer; a hybrid
    one (Gemma 3) groups its layers by attention type into groups of equal size, and the blocks
    of a sliding-window group age out of the window."""

    name: str
    layer_indices: tuple[int, ...]
    sliding_window: int | None = None  # tokens; None = full attention

    def max_blocks(self, block_size: int, num_tokens: int, max_chunk_tokens: int) -> int:
        """Blocks one sequence of num_tokens holds at most in this group: all of them, or in a
        sliding group its window plus the largest chunk a step computes."""
        num_blocks = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return num_blocks
        window_blocks = -(-(self.sliding_window - 1 + max_chunk_tokens) // block_size) + 1
        return min(num_blocks, window_blocks)


@dataclass(frozen=True, slots=True)
class KVLayout:
    block_size: int  # tokens per block
    num_blocks: int  # blocks in the device pool
    kv_cache_dtype: str  # the pages' dtype name, e.g. "float32", "fp8_e4m3"
    bytes_per_token: int  # K and V of one block's layers (layers_per_block of them) per token
    namespace_root: BlockHash  # parent hash of every chain's first block
    hash_algorithm: str
    groups: tuple[KVGroup, ...]

    def __post_init__(self) -> None:
        check_algorithm(self.hash_algorithm)
        for name in ("block_size", "num_blocks", "bytes_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.groups:
            raise ValueError("a KV layout needs at least one group of layers")

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_indices) for g in self.groups)

    @property
    def layers_per_block(self) -> int:
        """Layers whose K/V one block holds: the largest group (smaller ones leave slots idle)."""
        return max(len(g.layer_indices) for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def new_hasher(self) -> RequestHasher:
        """The hasher every request of this engine hashes its blocks with."""
        return RequestHasher(self.namespace_root, self.block_size, self.hash_algorithm)


def first_window_block(num_computed: int, block_size: int, window: int) -> int:
    """Index of the first block a query at position >= num_computed sees through `window`
    tokens (it sees positions > position - window): blocks before it are never read again."""
    return max(0, num_computed - window + 1) // block_size


def full_attention_groups(num_layers: int) -> tuple[KVGroup, ...]:
    """One group holding every layer: the layout of a model without sliding-window layers."""
    return (KVGroup("full", tuple(range(num_layers))),)


def attention_type_groups(layer_windows: Sequence[int | None]) -> tuple[KVGroup, ...]:
    """Groups of equal size by attention type: full-attention layers first, then each window.

    Size is the smallest type's layer count (vLLM's hybrid allocator does the same), so one
    block is one page of that many layers whatever group holds it. Gemma 3 270m: 3 full layers
    and 15 sliding ones become 1 + 5 groups of 3. One type only: one group of every layer.
    """
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_type.setdefault(window, []).append(layer)
    if len(by_type) == 1 and None in by_type:
        return full_attention_groups(len(layer_windows))
    size = min(len(layers) for layers in by_type.values())
    groups: list[KVGroup] = []
    for window in sorted(by_type, key=lambda w: -1 if w is None else w):
        layers = by_type[window]
        name = "full" if window is None else f"sliding{window}"
        for start in range(0, len(layers), size):
            part = tuple(layers[start : start + size])
            groups.append(KVGroup(f"{name}.{start // size}", part, window))
    return tuple(groups)


def layer_slots(groups: Sequence[KVGroup]) -> dict[int, tuple[int, int]]:
    """layer -> (its group's index, its slot in that group's pages)."""
    return {
        layer: (g, slot)
        for g, group in enumerate(groups)
        for slot, layer in enumerate(group.layer_indices)
    }
