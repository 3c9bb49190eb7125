"""KV cache events: what entered and left the block-hash map, for routers and external indexes.

Invariant: events are immutable and emitted in the order the pool changed its map.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmemo.kv.hashing import BlockHash, ExtraKeys


@dataclass(frozen=True)
class BlockStored:
    """Full blocks whose KV now exists and can be hit (one chain, in order)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None  # hash before block_hashes[0] (the root for block 0)
    token_ids: tuple[int, ...]  # tokens of all stored blocks, concatenated
    block_size: int  # tokens per block
    extra_keys: ExtraKeys  # extra keys of the (first) stored block


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the map (their pages were reallocated)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
