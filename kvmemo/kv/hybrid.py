"""HybridKVCacheManager: one block pool, one KVCacheManager per layer group, one hit length.

A hybrid model (Gemma 3: five sliding-window layers to each full one) keeps its layers in groups
of equal size, so every block is one page of the same bytes whichever group holds it, and all
groups draw from one pool and one eviction order: memory flows to whichever group needs it. Each
group has its own block table per request and its own (group, hash) entries in the pool's map;
a sliding group releases the blocks its window no longer sees.

Invariant: a prefix hit serves num_tokens only if EVERY group can: full groups hold every block
below it, sliding groups the blocks their window sees from the first new token on (and each
group a partial source when num_tokens is not block-aligned). Allocation is all-or-nothing across
groups. Events and prefix-cache counters speak for group 0, the full-attention group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvmemo.kv.block import Block
from kvmemo.kv.block_pool import BlockPool
from kvmemo.kv.events import KVEvent
from kvmemo.kv.eviction import DEFAULT_EVICTION_POLICY
from kvmemo.kv.hashing import BlockHash
from kvmemo.kv.layout import KVLayout
from kvmemo.kv.manager import KVCacheManager
from kvmemo.kv.match import NO_MATCH, BlockCopy, BlockIds, PrefixCacheStats, PrefixMatch

if TYPE_CHECKING:
    from kvmemo.request import Request


class HybridKVCacheManager:
    """The KVCacheManager API over several layer groups sharing one pool (see module doc)."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        enable_caching: bool = True,
        enable_partial_reuse: bool = True,
        enable_events: bool = False,
        eviction_policy: str = DEFAULT_EVICTION_POLICY,
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.num_blocks = layout.num_blocks
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            layout.num_blocks, enable_caching, enable_events, eviction_policy=eviction_policy
        )
        self.groups = [
            KVCacheManager(
                layout,
                enable_caching=enable_caching,
                enable_partial_reuse=enable_partial_reuse,
                group=index,
                block_pool=self.block_pool,
            )
            for index in range(len(layout.groups))
        ]
        partial_indexes = [index for g in self.groups for index in g.pool_partial_indexes]
        for group in self.groups:
            group.pool_partial_indexes = partial_indexes

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def stats(self) -> PrefixCacheStats:
        return self.groups[0].stats

    def take_stats(self) -> PrefixCacheStats:
        return self.groups[0].take_stats()

    def blocks_needed(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """Blocks one request of num_tokens holds at most, over all groups."""
        return sum(g.blocks_needed(num_tokens, max_chunk_tokens) for g in self.groups)

    # ---- prefix match ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> PrefixMatch:
        """The longest prefix every group can serve (module doc), with each group's match.

        Starts from group 0's own longest match and shortens it (the partial first, then one
        block at a time) until every other group can serve exactly that many tokens.
        """
        first = self.groups[0].get_computed_blocks(request)
        num_tokens = first.num_tokens
        others: list[PrefixMatch] = []
        while num_tokens > 0:
            found = [g.match_exactly(request, num_tokens) for g in self.groups[1:]]
            if all(m is not None for m in found):
                others = [m for m in found if m is not None]
                break
            num_tokens = (num_tokens - 1) // self.block_size * self.block_size
        if num_tokens == 0:
            return NO_MATCH
        if num_tokens != first.num_tokens:
            first = PrefixMatch(first.blocks[: num_tokens // self.block_size], num_tokens)
        return PrefixMatch(first.blocks, num_tokens, first.partial, (first, *others))

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: PrefixMatch | None = None
    ) -> list[int] | None:
        """Every group's allocate_slots, or none of them: returns group 0's new block ids, or
        None (nothing allocated) when the pool cannot cover all groups' new blocks."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        for group in self.groups:
            group.release_outside_window(request)  # first: what slid out makes room
        matches: Sequence[PrefixMatch | None] = [None] * len(self.groups)
        if prefix is not None and prefix.num_tokens == 0:
            matches = [NO_MATCH] * len(self.groups)
        elif prefix is not None:
            if len(prefix.group_matches) != len(self.groups):
                raise ValueError("a hybrid allocation needs the match get_computed_blocks gave")
            matches = prefix.group_matches
        # A free hit (or partial source) of one group must survive the pops of another, so all
        # are taken before any group pops; taken hits count against capacity like new blocks.
        free_hits: dict[int, Block] = {}
        for match in matches:
            if match is None:
                continue
            sources = [*match.blocks, match.partial.block if match.partial else None]
            for block in sources:
                if block is not None and block.ref_count == 0:
                    free_hits[block.block_id] = block
        needed = sum(
            g.num_new_blocks(request, num_new_tokens, m) for g, m in zip(self.groups, matches)
        )
        if needed + len(free_hits) > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(free_hits.values())
        new_ids: list[int] | None = None
        for group, match in zip(self.groups, matches):
            ids = group.allocate_slots(request, num_new_tokens, match)
            assert ids is not None, "capacity was checked for every group"
            new_ids = ids if new_ids is None else new_ids
        self.block_pool.free_blocks(free_hits.values())  # partial sources not adopted rejoin free
        assert new_ids is not None
        return new_ids

    # ---- publish and release ---------------------------------------------------------------

    def commit(self, request: Request, num_computed_tokens: int) -> None:
        for group in self.groups:
            group.commit(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Frees every group's blocks; sliding groups first, so the full group's blocks (what a
        hit needs most) are freed last and evicted last."""
        for group in reversed(self.groups):
            group.free(request)

    def check_retention(self, request: Request) -> None:
        self.groups[0].check_retention(request)

    def retain(self, request: Request) -> None:
        """Group 0 first: the other groups' blocks are retained only where its are."""
        for group in self.groups:
            group.retain(request)

    @property
    def max_retained_blocks(self) -> int:
        return self.groups[0].max_retained_blocks

    @max_retained_blocks.setter
    def max_retained_blocks(self, value: int) -> None:
        for group in self.groups:
            group.max_retained_blocks = value

    @property
    def max_retained_tokens(self) -> int:
        return self.groups[0].max_retained_tokens

    def fork(self, parent: Request, child: Request) -> None:
        for group in self.groups:
            group.fork(parent, child)

    def finish_beams(self, final: Sequence[Request], pruned: Sequence[Request]) -> None:
        for group in reversed(self.groups):
            group.finish_beams(final, pruned)

    def get_block_table(self, request_id: str) -> list[int | None]:
        return self.groups[0].get_block_table(request_id)

    def get_group_block_tables(self, request_id: str) -> list[list[int | None]]:
        """Each group's block table of the request, in layout.groups order."""
        return [g.get_block_table(request_id) for g in self.groups]

    def drop_partial(self, request: Request, prefix: PrefixMatch) -> PrefixMatch | None:
        """`prefix` shortened to its full blocks, or None when a sliding group cannot serve
        that shorter hit (its window then starts at a block it may not have)."""
        num_tokens = len(prefix.blocks) * self.block_size
        if num_tokens == 0:
            return NO_MATCH
        others = [g.match_exactly(request, num_tokens) for g in self.groups[1:]]
        if any(m is None for m in others):
            return None
        first = PrefixMatch(prefix.blocks, num_tokens)
        return PrefixMatch(first.blocks, num_tokens, None, (first, *[m for m in others if m]))

    def extend_in_flight(
        self, request: Request, prefix: PrefixMatch, computing: Mapping[BlockHash, Request]
    ) -> PrefixMatch:
        """`prefix` unchanged: sharing blocks computed in the same step is left to single-group
        layouts (a sliding group would need each group's window agreed on blocks not yet
        written), so here such a request waits a step for them to commit."""
        return prefix

    def cached_block_ids(self, block_hash: BlockHash) -> BlockIds | None:
        """Every group's cached block under `block_hash`, or None if a group lacks it (a store
        payload holds all layers, so a block is saved only whole)."""
        ids = [g.cached_block_id(block_hash) for g in self.groups]
        if any(i is None for i in ids):
            return None
        return tuple(i for i in ids if i is not None)

    def load_targets(self, request: Request, first: int, count: int) -> list[BlockIds]:
        """Per block first..first+count-1 of the request, its id in every group."""
        per_group = [g.load_targets(request, first, count) for g in self.groups]
        return list(zip(*per_group))

    def take_copies(self) -> list[BlockCopy]:
        return [copy for g in self.groups for copy in g.take_copies()]

    def take_events(self) -> list[KVEvent]:
        return self.block_pool.take_events()

    def reset_prefix_cache(self) -> tuple[bool, str]:
        ok, reason = self.block_pool.reset_prefix_cache()
        if ok:
            for group in self.groups:
                group.clear_partial_index()
        return ok, reason

    def check_invariants(self) -> None:
        """Pool invariants, each group's tables, and ref_count == holders over all groups."""
        self.block_pool.check_invariants()
        holders: dict[int, int] = {}
        for group in self.groups:
            for block_id, count in group.holder_counts().items():
                holders[block_id] = holders.get(block_id, 0) + count
        for group in self.groups:
            group.check_tables(holders)


# What the scheduler, the beam driver and the engine hold: either manager has the same API.
AnyKVCacheManager = KVCacheManager | HybridKVCacheManager
