"""Block: one KV page as the pool tracks it (ref count, hash and what it covers, free-queue links).

Invariant: the committed fields (hash, parent hash, tokens, extra keys, group) are set together by
set_committed and cleared together by reset_hash, when the pool unmaps the block.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmemo.kv.free_queue import FreeQueueNode
from kvmemo.kv.hashing import BlockHash, ExtraKeys


@dataclass(slots=True, eq=False)
class Block(FreeQueueNode):
    """One KV page. The committed fields are set together, once, by commit (see set_committed)."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None  # committed: hash of the previous block (or the root)
    token_ids: tuple[int, ...] | None = None  # committed: the tokens, to verify hits
    extra_keys: ExtraKeys | None = None  # committed: the extra keys, to verify hits
    group: int = 0  # committed: the layer group whose KV the block holds (the map key's part)
    retained_until: float = 0.0  # a hashed block's retention expiry (the ledger's clock); 0: none
    retained_by: str | None = None  # the retention's owner (a cache_salt), while retained
    retention_lapsed: bool = False  # its retention ran out (a miss cause once it is evicted)
    reuses: int = 0  # hits since it was committed (eviction.py: policies read, and may lower, it)
    segment: int = 0  # which of its eviction policy's queues holds it while free

    def set_committed(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash,
        token_ids: tuple[int, ...],
        extra_keys: ExtraKeys,
        group: int = 0,
    ) -> None:
        """Assigns the hash and what it covers; a block is hashed at most once until evicted."""
        assert self.block_hash is None, f"block {self.block_id} already has a hash"
        self.group = group
        self.block_hash = block_hash
        self.parent_hash = parent_hash
        self.token_ids = token_ids
        self.extra_keys = extra_keys

    def reset_hash(self) -> None:
        self.block_hash = self.parent_hash = self.token_ids = self.extra_keys = None
        self.group = 0
        self.retention_lapsed = False
        self.reuses = 0

