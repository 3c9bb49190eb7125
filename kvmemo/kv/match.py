"""What the KV cache manager hands out: prefix matches, block copies and prefix-cache stats.

Invariant: these records are plain data; a PrefixMatch is only valid until the pool changes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvmemo.kv.block import Block
from kvmemo.kv.hashing import BlockHash

# A block's id, or for a hybrid layout (kv/hybrid.py: layer groups with their own blocks) one
# id per group. Both managers hand out this one type, so a store or the scheduler never asks
# which manager it holds.
BlockIds = int | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy the KV of the first num_tokens slots of block src into block dst (partial reuse)."""

    src_block_id: int
    dst_block_id: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PartialMatch:
    """A block whose first num_tokens slots hold the request's next tokens (partial reuse).

    The block is either partially filled (from the partial index; source_hash None) or a committed
    full block that the request diverges from (or ends in) mid-block (source_hash: its hash).
    """

    block: Block
    num_tokens: int
    source_hash: BlockHash | None = None  # set for a committed full source, to detect eviction


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    # Verified full-block hits, in order; None where a sliding-window group needs no block.
    blocks: tuple[Block | None, ...]
    num_tokens: int  # tokens served from cache: len(blocks) * block_size + partial tokens
    partial: PartialMatch | None = None
    # A hybrid layout's match: one per layer group, all of num_tokens (group 0's is this one's
    # blocks and partial); empty for a single-group layout.
    group_matches: tuple[PrefixMatch, ...] = ()
    # The last num_in_flight of `blocks` are not committed yet: another request computes them in
    # the step being scheduled (KVCacheManager.extend_in_flight). Their KV is written in that
    # step's forward before any attention reads it (the AttentionBackend invariant).
    num_in_flight: int = 0


NO_MATCH = PrefixMatch(blocks=(), num_tokens=0, partial=None)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters (cumulative from manager.stats, per interval from take_stats())."""

    num_queries_tokens: int = 0  # tokens of requests at their first allocation
    num_hit_tokens: int = 0  # of those, served from the cache (full blocks + partial)
    num_partial_hit_tokens: int = 0  # of the hits, served by partial reuse
    num_evicted_blocks: int = 0
    num_stored_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queries_tokens if self.num_queries_tokens else 0.0

    def minus(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(
            *(getattr(self, f.name) - getattr(other, f.name) for f in fields(self))
        )
