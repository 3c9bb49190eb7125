"""PartialIndex: partially filled blocks whose computed KV a new request may copy, by parent hash.

Invariant: an entry's tokens are exactly the tokens whose KV sits in the first slots of its block
(1 <= len < block_size); the block is unhashed; at most one entry per block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmemo.kv.block import Block
from kvmemo.kv.hashing import BlockHash, ExtraKeys


@dataclass(frozen=True, slots=True)
class PartialEntry:
    block: Block
    parent_hash: BlockHash  # hash of the full block before it (or the namespace root)
    extra_keys: ExtraKeys  # extra keys over the entry's token range
    token_ids: tuple[int, ...]  # tokens whose KV is computed, from the block's first slot


class PartialIndex:
    """Owns the partial entries, keyed by parent hash and by block id."""

    def __init__(self) -> None:
        self._by_parent: dict[BlockHash, dict[int, PartialEntry]] = {}
        self._by_block: dict[int, PartialEntry] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    def entries(self) -> list[PartialEntry]:
        return list(self._by_block.values())

    def get(self, block: Block) -> PartialEntry | None:
        return self._by_block.get(block.block_id)

    def put(self, entry: PartialEntry) -> None:
        """Adds or replaces the entry of entry.block."""
        self.discard(entry.block)
        self._by_block[entry.block.block_id] = entry
        self._by_parent.setdefault(entry.parent_hash, {})[entry.block.block_id] = entry

    def discard(self, block: Block) -> None:
        """Drops the entry of `block`, if any (its slots are about to be overwritten or hashed)."""
        entry = self._by_block.pop(block.block_id, None)
        if entry is None:
            return
        siblings = self._by_parent[entry.parent_hash]
        del siblings[block.block_id]
        if not siblings:
            del self._by_parent[entry.parent_hash]

    def clear(self) -> None:
        self._by_parent.clear()
        self._by_block.clear()

    def find(
        self,
        parent_hash: BlockHash,
        token_ids: Sequence[int],
        extra_keys_for: Callable[[int], ExtraKeys],
    ) -> tuple[Block, int] | None:
        """The entry sharing the longest token prefix k > 0 with `token_ids`, and k.

        Args:
            parent_hash: the hash the new request's block chains from.
            token_ids: the new request's next tokens (already capped by the caller).
            extra_keys_for: the new request's extra keys over the first m tokens of the block;
                an entry of m tokens matches only if its extra keys equal extra_keys_for(m).
        """
        best: tuple[Block, int] | None = None
        for entry in self._by_parent.get(parent_hash, {}).values():
            k = common_prefix_len(entry.token_ids, token_ids)
            if k == 0 or (best is not None and k <= best[1]):
                continue
            if entry.extra_keys == extra_keys_for(len(entry.token_ids)):
                best = (entry.block, k)
        return best


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading positions where `a` and `b` agree."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
