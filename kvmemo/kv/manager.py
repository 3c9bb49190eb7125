"""KVCacheManager: each request's block_table, prefix hits and the one publish point, commit().

Invariant: a block becomes hittable only in commit(), which the engine calls AFTER the step that
computed its KV (never for scheduled-but-uncomputed tokens, e.g. later chunks of a prefill), and
every block's ref_count equals the number of block tables holding it.

One manager serves one layer group of the layout (group 0 by default: every layer of a plain
model). In a sliding-window group a block table holds None where blocks slid out of the window
were released; hybrid.py composes one manager per group over a shared pool. Its read-only
matching is in matcher.py (PrefixMatcher), its tables' views and checks in tables.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvmemo.kv.block import Block
from kvmemo.kv.block_pool import BlockPool
from kvmemo.kv.events import KVEvent
from kvmemo.kv.eviction import DEFAULT_EVICTION_POLICY
from kvmemo.kv.hashing import BlockHash, extra_keys_for_range
from kvmemo.kv.layout import KVLayout
from kvmemo.kv.match import BlockCopy, BlockIds, PrefixCacheStats, PrefixMatch
from kvmemo.kv.matcher import PrefixMatcher, RequestBlocks
from kvmemo.kv.partial_index import PartialEntry, PartialIndex
from kvmemo.kv.retained_prefixes import RetainedPrefixes
from kvmemo.kv.tables import BlockTables

if TYPE_CHECKING:
    from kvmemo.request import Request


class KVCacheManager(PrefixMatcher, BlockTables, RetainedPrefixes):
    """Owns the block pool, every running request's block_table, the partial index and copies.

    Promises: hits are verified against stored tokens, parent hash and extra keys (a hash
    collision cannot serve wrong KV); the last token of a request is never a hit; a partially
    filled block is never shared, only copied (or adopted when nobody holds it); a committed full
    block used as a partial source is only read (copied), and stays cached, unless it would be
    evicted by this very allocation anyway.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        enable_caching: bool = True,
        enable_partial_reuse: bool = True,
        enable_events: bool = False,
        group: int = 0,
        block_pool: BlockPool | None = None,
        eviction_policy: str = DEFAULT_EVICTION_POLICY,
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.num_blocks = num_blocks = layout.num_blocks
        self.enable_caching = enable_caching
        self.enable_partial_reuse = enable_caching and enable_partial_reuse
        self.group = group
        # Tokens a query sees back from itself in this group's layers; None: the whole context.
        self.window = layout.groups[group].sliding_window
        self.block_pool = block_pool or BlockPool(num_blocks, enable_caching, enable_events,
                                                  eviction_policy=eviction_policy)
        # Parent hashes and extra keys of blocks; requests extend their own block hashes.
        self._hasher = layout.new_hasher()
        self._requests: dict[str, RequestBlocks] = {}
        self._partial = PartialIndex()
        # Every partial index over this pool (the hybrid manager lists all groups'): a block
        # taken anew by one group must leave the others' indexes too, as its slots are rewritten.
        self.pool_partial_indexes: list[PartialIndex] = [self._partial]
        self._copies: list[BlockCopy] = []
        self._counters = PrefixCacheStats()  # query/hit counters; pool counts evict/store
        self._taken = PrefixCacheStats()
        # Group-0 blocks one cache_salt may hold under retention (retention.py); the builder
        # sets the engine's figure.
        self.max_retained_blocks = max(1, num_blocks // 4)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def stats(self) -> PrefixCacheStats:
        """Cumulative counters (a fresh snapshot on every read)."""
        return replace(
            self._counters,
            num_evicted_blocks=self.block_pool.num_evicted_blocks,
            num_stored_blocks=self.block_pool.num_stored_blocks,
        )

    def take_stats(self) -> PrefixCacheStats:
        """Counters since the previous take_stats() call."""
        current = self.stats
        delta, self._taken = current.minus(self._taken), current
        return delta

    def blocks_needed(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """Blocks one request of num_tokens holds at most in this group: all of them, or in a
        sliding group the window plus the largest chunk a step computes."""
        return self.layout.groups[self.group].max_blocks(
            self.block_size, num_tokens, max_chunk_tokens
        )

    def drop_partial(self, request: Request, prefix: PrefixMatch) -> PrefixMatch | None:
        """`prefix` without its partial block (the store holds that whole block). `request` is
        unused by one group; the hybrid manager matches its other groups against it."""
        return replace(prefix, partial=None, num_tokens=len(prefix.blocks) * self.block_size)

    def cached_block_ids(self, block_hash: BlockHash) -> BlockIds | None:
        """The ids of the cached block under `block_hash` (what a store saves), or None."""
        return self.cached_block_id(block_hash)

    def cached_block_id(self, block_hash: BlockHash) -> int | None:
        """The id of this group's cached block under `block_hash`, or None."""
        block = self.block_pool.get_cached_block(block_hash, self.group)
        return block.block_id if block is not None else None

    def clear_partial_index(self) -> None:
        self._partial.clear()

    def release_outside_window(self, request: Request, num_computed: int | None = None) -> None:
        """Frees this request's blocks that no future query of it can see (sliding-window group
        only; blocks before num_computed - window + 1, num_computed defaulting to the request's).
        They stay cached, as any freed block does, for hits of requests whose window needs them."""
        if self.window is None:  # first: the common case, a full-attention group
            return
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_computed is None:
            num_computed = request.num_computed_tokens
        first = min(self.first_needed_block(num_computed), len(state.blocks))
        released = [block for block in state.blocks[:first] if block is not None]
        if released:
            state.blocks[:first] = [None] * first
            self.block_pool.free_blocks(reversed(released))

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: PrefixMatch | None = None
    ) -> list[int] | None:
        """Grows the request's block_table to cover its computed tokens plus `num_new_tokens`.

        ::

            block_table: | hit | hit | partial  | new | new |
                         |<- prefix.num_tokens ->|<- num_new_tokens ->|
                         touched     copy dst     the eviction policy's victims
                         (ref += 1)  (or adopted)  (their old hashes evicted)

        Partial match (prefix.partial), by source kind and state:

            source                 referenced               free (ref_count 0)
            partially filled       fresh dst + BlockCopy    adopted as is (no copy)
            committed full block   fresh dst + BlockCopy    fresh dst + BlockCopy; the source is
                                                            kept out of the pops, then rejoins the
                                                            free queue as freed now, still cached;
                                                            if the free blocks fit the request only
                                                            by popping the source too, it is
                                                            adopted instead (evicted, no copy)

        Args:
            request: the request; without `prefix` its num_computed_tokens is the start.
            num_new_tokens: tokens to be computed by the coming step.
            prefix: the match from get_computed_blocks, called right before, on the request's
                first allocation only. Its full blocks are touched, its partial match handled as
                above. Run the BlockCopy records in order, before the step's forward (and before
                any KV write of that step): take_copies().

        Returns:
            The newly added block ids, or None (nothing changed) if the free blocks cannot cover
            the new blocks plus the hits that are currently free.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        state = self._requests.get(request.request_id)
        if prefix is not None and state is not None:
            raise ValueError(f"prefix given for {request.request_id!r}, which already has blocks")
        self.release_outside_window(request)  # first: what slid out makes room
        hit_entries = prefix.blocks if prefix is not None else ()
        hits = [block for block in hit_entries if block is not None]
        partial = prefix.partial if prefix is not None else None
        num_computed = prefix.num_tokens if prefix is not None else request.num_computed_tokens
        num_new_blocks, shared_tail = self._growth(request, num_new_tokens, prefix)
        # Free hits leave the free queue, so they use capacity; an adopted source block is one of
        # the new blocks, taken from the free queue like a fresh one.
        num_free_hits = sum(block.ref_count == 0 for block in hits)
        num_free = self.block_pool.num_free_blocks
        if num_new_blocks + num_free_hits + (shared_tail is not None) > num_free:
            return None
        if shared_tail is not None:
            assert state is not None  # _shared_tail finds a shared tail only in existing blocks
            self._copy_on_write(state, shared_tail, num_computed % self.block_size)
        if prefix is not None:
            self._check_fresh(request, prefix)
            for block in prefix.blocks[len(prefix.blocks) - prefix.num_in_flight :]:
                assert block is not None
                self._forget_partial(block)  # shared now, and full after the step

        self.block_pool.touch(hits)  # first: a free hit must not be popped below
        new_blocks: list[Block] = []
        # A free full source survives only if the pops leave it out; when every free block is
        # needed, it would be popped (evicted) anyway, so adopt it and keep its first slots' KV.
        if (
            partial is not None
            and partial.block.ref_count == 0
            and (partial.source_hash is None or num_new_blocks + num_free_hits == num_free)
        ):
            self.block_pool.take_free_block(partial.block)  # evicts a full source's hash first
            new_blocks.append(partial.block)
            partial = None  # adopted: no copy
        kept = partial.block if partial is not None and partial.block.ref_count == 0 else None
        if kept is not None:
            self.block_pool.touch([kept])  # out of the free queue: the pops cannot take it
        fresh = self.block_pool.get_new_blocks(num_new_blocks - len(new_blocks))
        if kept is not None:
            self.block_pool.free_blocks([kept])  # back at the tail: just used, still cached
        new_blocks.extend(fresh)
        for block in new_blocks:
            self._forget_partial(block)  # its slots are about to be rewritten
        if partial is not None:
            copy = BlockCopy(partial.block.block_id, fresh[0].block_id, partial.num_tokens)
            self._copies.append(copy)

        if state is None:
            state = RequestBlocks(request, list(hit_entries), len(hit_entries))
            self._requests[request.request_id] = state
            self._record_query(request, prefix)
        state.blocks.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def num_new_blocks(
        self, request: Request, num_new_tokens: int, prefix: PrefixMatch | None = None
    ) -> int:
        """Blocks allocate_slots would take from the free queue (free hits not counted)."""
        num_new_blocks, shared_tail = self._growth(request, num_new_tokens, prefix)
        return num_new_blocks + (shared_tail is not None)

    def _growth(
        self, request: Request, num_new_tokens: int, prefix: PrefixMatch | None
    ) -> tuple[int, int | None]:
        """(blocks the table grows by, index of a fork-shared tail to copy before writing)."""
        state = self._requests.get(request.request_id)
        num_computed = prefix.num_tokens if prefix is not None else request.num_computed_tokens
        if state is not None:
            num_held = len(state.blocks)
        else:
            num_held = len(prefix.blocks) if prefix is not None else 0
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        shared_tail = self._shared_tail(state, num_computed) if num_new_tokens > 0 else None
        return max(0, num_required - num_held), shared_tail

    def _shared_tail(self, state: RequestBlocks | None, num_computed: int) -> int | None:
        """Index of the partially filled block the next token writes into, if a fork shares it."""
        offset = num_computed % self.block_size
        if state is None or offset == 0:
            return None
        index = num_computed // self.block_size
        block = state.blocks[index]
        return index if block is not None and block.ref_count > 1 else None

    def _copy_on_write(self, state: RequestBlocks, index: int, num_tokens: int) -> None:
        """Replaces the shared partial block `index` by a fresh private copy of its first slots.

        The other holders keep the source (its ref_count drops by one); the copy runs before the
        step's forward, so it reads the source before any holder writes past num_tokens.
        """
        source = state.blocks[index]
        assert source is not None  # the block being written into is inside any window
        (copy,) = self.block_pool.get_new_blocks(1)
        self._forget_partial(copy)
        self._copies.append(BlockCopy(source.block_id, copy.block_id, num_tokens))
        state.blocks[index] = copy
        self.block_pool.free_blocks([source])

    def _forget_partial(self, block: Block) -> None:
        for index in self.pool_partial_indexes:
            index.discard(block)

    def _check_fresh(self, request: Request, prefix: PrefixMatch) -> None:
        """Asserts `prefix` is still valid: no allocation evicted its blocks since the match."""
        num_cached = len(prefix.blocks) - prefix.num_in_flight
        for index, block in enumerate(prefix.blocks[:num_cached]):
            if block is not None:
                assert block.block_hash == request.block_hashes[index], "stale PrefixMatch"
        for block in prefix.blocks[num_cached:]:  # in flight: held by the request computing them
            assert block is not None and block.block_hash is None and block.ref_count > 0
        if prefix.partial is not None and prefix.partial.source_hash is not None:
            assert prefix.partial.block.block_hash == prefix.partial.source_hash, (
                "stale PrefixMatch: its full source block was evicted"
            )
        elif prefix.partial is not None:
            entry = self._partial.get(prefix.partial.block)
            assert entry is not None and len(entry.token_ids) >= prefix.partial.num_tokens, (
                "stale PrefixMatch: its partial block was reallocated"
            )
            num_full_tokens = len(prefix.blocks) * self.block_size
            assert prefix.num_tokens == num_full_tokens + prefix.partial.num_tokens

    def _record_query(self, request: Request, prefix: PrefixMatch | None) -> None:
        self._counters.num_queries_tokens += request.num_tokens
        if prefix is not None:
            self._counters.num_hit_tokens += prefix.num_tokens
            if prefix.partial is not None:
                self._counters.num_partial_hit_tokens += prefix.partial.num_tokens

    # ---- publish and release ---------------------------------------------------------------

    def commit(self, request: Request, num_computed_tokens: int) -> None:
        """Publishes the request's KV that exists after a step: the publish point.

        Commits each full block below num_computed_tokens once (stored once: a block whose hash
        is already mapped stays private), and records the computed part of the last, partial
        block in the partial index. Call AFTER the step that computed the KV. Commits nothing
        when caching is off. In a sliding-window group, the blocks the window no longer sees
        are then released (after they were committed, so they stay hittable).
        """
        if not self.enable_caching:
            self.release_outside_window(request, num_computed_tokens)
            return
        state = self._requests.get(request.request_id)
        assert state is not None, f"commit for {request.request_id!r}, which holds no blocks"
        size = self.block_size
        assert num_computed_tokens <= min(request.num_tokens, len(state.blocks) * size)
        tokens = request.all_token_ids
        num_full = num_computed_tokens // size
        assert len(request.block_hashes) >= num_full, (
            f"request {request.request_id!r} has no block hashes: build it with the engine's hasher"
        )
        for index in range(state.num_committed_blocks, num_full):
            block = state.blocks[index]
            if block is None:  # released by the window before a beam's deferred commit
                continue
            start = index * size
            self._partial.discard(block)
            self.block_pool.commit_block(
                block,
                request.block_hashes[index],
                self._hasher.parent_hash(request, index),
                tuple(tokens[start : start + size]),
                self._hasher.extra_keys(request, index),
                self.group,
            )
        num_tail = num_computed_tokens - num_full * size
        if self.enable_partial_reuse and num_tail > 0 and num_full >= state.num_committed_blocks:
            start = num_full * size
            block = state.blocks[num_full]
            assert block is not None and block.block_hash is None, (
                "a partially computed block cannot be hashed"
            )
            self._partial.put(
                PartialEntry(
                    block=block,
                    parent_hash=self._hasher.parent_hash(request, num_full),
                    extra_keys=extra_keys_for_range(request, start, num_computed_tokens),
                    token_ids=tuple(tokens[start:num_computed_tokens]),
                )
            )
        if self.group == 0:  # what explaining later misses needs (miss_causes.py)
            self.block_pool.misses.note_committed(
                request, state.num_committed_blocks, num_full, size)
        state.num_committed_blocks = max(state.num_committed_blocks, num_full)
        self.release_outside_window(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first into the free queue (to its head if the
        request's priority is above 0), and forgets it. Blocks stay cached until evicted; a
        request that holds no blocks (never allocated, or already freed) is ignored."""
        if (state := self._requests.pop(request.request_id, None)) is not None:
            blocks = [b for b in reversed(state.blocks) if b is not None]
            self.block_pool.free_blocks(blocks, evict_first=request.priority > 0)

    # ---- beams: fork copy-on-write, publish only the winners -------------------------------

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` the parent's blocks covering child.num_computed_tokens, by reference.

        Full blocks and a partially filled last block alike are shared (ref_count += 1): the
        first holder to write into a shared partial block gets a private copy in allocate_slots
        (copy-on-write), the last one writes in place. A shared partial block leaves the partial
        index (a partial-reuse source has a single owner). Allocates nothing, so it cannot fail
        for capacity; child.block_hashes must equal the parent's over the shared full blocks.

        Raises:
            ValueError: if the child already holds blocks or the parent's blocks do not cover
                child.num_computed_tokens.
        """
        state = self._requests.get(parent.request_id)
        num_tokens = child.num_computed_tokens
        num_blocks = -(-num_tokens // self.block_size)
        if state is None or len(state.blocks) < num_blocks or num_tokens > parent.num_tokens:
            raise ValueError(
                f"fork of {parent.request_id!r} needs parent blocks covering the child's "
                f"{num_tokens} computed tokens"
            )
        if child.request_id in self._requests:
            raise ValueError(f"fork child {child.request_id!r} already holds blocks")
        blocks = state.blocks[:num_blocks]
        self.block_pool.touch(b for b in blocks if b is not None)
        if num_tokens % self.block_size:
            tail = blocks[-1]
            assert tail is not None  # the block being written into is inside any window
            self._partial.discard(tail)
        num_committed = min(state.num_committed_blocks, num_tokens // self.block_size)
        self._requests[child.request_id] = RequestBlocks(child, list(blocks), num_committed)

    def finish_beams(self, final: Sequence[Request], pruned: Sequence[Request]) -> None:
        """Ends a beam search: publishes the final beams' full blocks, then frees every beam.

        Beams skip commit() while they run, so a pruned beam never advertised a block. Here each
        final beam commits the full blocks of its computed tokens (shared blocks once, stored
        once), then the pruned beams are freed, then the final ones, best (first) last, so the
        winner's tail is evicted last. One call, so the invariants hold before and after.
        """
        for request in final:
            state = self._requests[request.request_id]
            num_full_tokens = request.num_computed_tokens // self.block_size * self.block_size
            if num_full_tokens // self.block_size > state.num_committed_blocks:
                self.commit(request, num_full_tokens)
        for request in [*pruned, *reversed(final)]:
            self.free(request)

    def take_copies(self) -> list[BlockCopy]:
        """Drains the block copies recorded since the last call; run them in order before the
        forward of the step they were scheduled for."""
        copies, self._copies = self._copies, []
        return copies

    def take_events(self) -> list[KVEvent]:
        """Drains the pool's KV events (empty unless enable_events)."""
        return self.block_pool.take_events()

    def reset_prefix_cache(self) -> tuple[bool, str]:
        """Forgets all cached blocks (full and partial) if no request holds any block.

        Returns:
            (True, "") on success, else (False, reason) and nothing changes.
        """
        ok, reason = self.block_pool.reset_prefix_cache()
        if ok:
            self._partial.clear()
        return ok, reason
