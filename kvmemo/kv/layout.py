"""KVLayout: how one engine lays out and names its KV blocks, built once and shared.

Invariant: every part that depends on block size, pool size, KV dtype or the namespace (the
hasher, the manager, the paged cache, the store connector) reads it from the one KVLayout the
engine built, so they cannot disagree. Torch-free: the dtype is its name.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmemo.kv.hashing import BlockHash, RequestHasher, check_algorithm


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers that share one block table. Every layer attends to the full context today; a
    sliding-window model (Gemma 3) adds a second group whose blocks age out of the window."""

    name: str
    layer_indices: tuple[int, ...]
    sliding_window: int | None = None  # tokens; None = full attention


@dataclass(frozen=True, slots=True)
class KVLayout:
    block_size: int  # tokens per block
    num_blocks: int  # blocks in the device pool
    kv_cache_dtype: str  # the pages' dtype name, e.g. "float32", "fp8_e4m3"
    bytes_per_token: int  # all layers, K and V
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
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def new_hasher(self) -> RequestHasher:
        """The hasher every request of this engine hashes its blocks with."""
        return RequestHasher(self.namespace_root, self.block_size, self.hash_algorithm)


def full_attention_groups(num_layers: int) -> tuple[KVGroup, ...]:
    """One group holding every layer: the layout of a model without sliding-window layers."""
    return (KVGroup("full", tuple(range(num_layers))),)
