"""BlockPool: every KV block's ref count, hash and free-queue position, plus the hash -> block map.

Invariant: each block is free (ref_count 0, in a free queue) xor referenced; a free block sits in
the retained queue iff it has an unexpired retention (retention.py), else in the eviction
policy's queues (eviction.py); a (group, hash) maps to at most one block and only blocks
carrying that hash in that group are mapped ("stored once"); the parent index holds exactly the
mapped blocks, each under its (group, parent hash).
Groups are the layout's attention-type groups sharing one pool (a hybrid model); a plain model
has only group 0. Events speak for group 0 only: its blocks are what a prefix hit needs first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvmemo.kv.block import Block
from kvmemo.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmemo.kv.eviction import DEFAULT_EVICTION_POLICY, EvictionPolicy, make_eviction_policy
from kvmemo.kv.free_queue import FreeBlockQueue
from kvmemo.kv.hashing import BlockHash, ExtraKeys
from kvmemo.kv.miss_ledger import MissLedger
from kvmemo.kv.retention import RetentionLedger


class BlockPool:
    """Owns all blocks, the free queues, the hash -> block map, the parent index and events.

    All num_blocks blocks are usable (no reserved null block). The pool knows nothing about
    requests: the manager decides which blocks to touch, commit, retain and free, and in what
    order. Eviction takes the eviction policy's next victim (`eviction_policy`, a name in
    eviction.EVICTION_POLICIES), and a retained block only when the policy holds none.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_events: bool = False,
        clock: Callable[[], float] | None = None,
        eviction_policy: str = DEFAULT_EVICTION_POLICY,
    ):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._free_queue: EvictionPolicy = make_eviction_policy(eviction_policy, self.blocks)
        # Free blocks under an unexpired retention, least recently freed first: evicted only
        # when the policy's queues are empty.
        self._retained_free: FreeBlockQueue[Block] = FreeBlockQueue()
        self.retention = RetentionLedger(clock) if clock else RetentionLedger()
        # What explaining a miss needs (miss_causes.py): about 200 bytes an entry, so bounded
        # by 4x the pool and 64Ki entries a table (about 40 MiB at most).
        self.misses = MissLedger(min(4 * num_blocks, 1 << 16))
        self.num_retained_evicted = 0  # cumulative: retained blocks evicted before their expiry
        self._cached: dict[tuple[int, BlockHash], Block] = {}  # (group, hash) -> block
        # (group, parent hash) -> {block_id: block} of the mapped blocks chained from it, in
        # commit order: the candidates for partial reuse of a committed full block.
        self._children: dict[tuple[int, BlockHash], dict[int, Block]] = {}
        self._events: list[KVEvent] = []
        self.num_evicted_blocks = 0  # cumulative
        self.num_stored_blocks = 0  # cumulative
        # Per block, how many times get_new_blocks or take_free_block handed it out: a block's
        # KV changes only after that (it then holds a new sequence's tokens), so an unchanged
        # generation means unchanged content for a full, computed block. Readers keep work
        # derived from a block (the attention's packed shared prefix) while its generation
        # stands.
        self.generations = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue) + len(self._retained_free)

    @property
    def num_retained_free_blocks(self) -> int:
        """Free blocks under retention (evicted only after every other free block)."""
        return len(self._retained_free)

    @property
    def eviction_policy(self) -> str:
        return self._free_queue.name

    def _queue_of(self, block: Block) -> EvictionPolicy | FreeBlockQueue[Block]:
        return self._retained_free if block.retained_until else self._free_queue

    def _pop_free(self) -> Block:
        if len(self._free_queue):
            return self._free_queue.popleft()
        block = self._retained_free.popleft()
        self.num_retained_evicted += block.group == 0
        return block

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (free cached blocks count as unused)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free block ids, next to evict first (for tests and debugging; O(num_free))."""
        return [block.block_id for queue in (self._free_queue, self._retained_free)
                for block in queue]

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Pops the eviction policy's next `num_blocks` victims, each with ref_count 1.

        Side effects: a popped block that carried a hash is evicted from the map (one
        BlockRemoved event per call, num_evicted_blocks counted). The caller checks capacity first;
        asking for more than num_free_blocks raises ValueError.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"num_blocks must be <= num_free_blocks ({self.num_free_blocks}), got {num_blocks}"
            )
        self.expire_retention()
        blocks = [self._pop_free() for _ in range(num_blocks)]
        removed: list[BlockHash] = []
        for block in blocks:
            assert block.ref_count == 0, f"free block {block.block_id} is referenced"
            block.ref_count = 1
            self.generations[block.block_id] += 1
            if block.block_hash is not None:
                if block.group == 0:
                    removed.append(block.block_hash)
                self._evict(block)
        if removed and self.enable_events:
            self._events.append(BlockRemoved(block_hashes=tuple(removed)))
        return blocks

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None and block.parent_hash is not None
        key, parent_key = (block.group, block.block_hash), (block.group, block.parent_hash)
        assert self._cached.get(key) is block
        del self._cached[key]
        siblings = self._children[parent_key]
        del siblings[block.block_id]
        if not siblings:
            del self._children[parent_key]
        self.num_evicted_blocks += block.group == 0  # counters, like events, speak for group 0
        self.misses.note_evicted(block.block_hash, block.retention_lapsed)
        self._end_retention(block)
        block.reset_hash()

    def take_free_block(self, block: Block) -> None:
        """Takes the free `block` as a new block (ref_count 1) whose old KV the caller keeps using.

        Like get_new_blocks for one chosen block: it leaves the free queue and, if it carried a
        hash, is evicted from the map first (BlockRemoved event, counted), so that no later hit
        can see the slots the caller is about to rewrite.
        """
        assert block.ref_count == 0, f"block {block.block_id} is not free"
        self._queue_of(block).remove(block)
        block.ref_count = 1
        self.generations[block.block_id] += 1  # its slots past the kept ones are rewritten
        if block.block_hash is not None:
            block_hash, group = block.block_hash, block.group
            self._evict(block)
            if self.enable_events and group == 0:
                self._events.append(BlockRemoved(block_hashes=(block_hash,)))

    def touch(self, blocks: Iterable[Block]) -> None:
        """Takes hit blocks: ref_count += 1, reuses += 1; a free one leaves the free queue (not
        evictable)."""
        for block in blocks:
            if block.ref_count == 0:
                self._queue_of(block).remove(block)
            block.ref_count += 1
            block.reuses += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[Block], evict_first: bool = False
                    ) -> None:
        """Drops one reference from each block; blocks reaching 0 join the free-queue tail in order.

        Pass a request's blocks last-first, so its tail is evicted before its shareable head.
        Freed blocks keep their hash (they stay hittable) until evicted. evict_first (a request
        of low priority): its unretained blocks that nobody else used (never hit) go to the
        head instead, still tail first, to be evicted before any other free block.
        """
        first: list[Block] = []
        for block in blocks_in_eviction_order:
            assert block.ref_count > 0, f"block {block.block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                if evict_first and not block.reuses and not block.retained_until:
                    first.append(block)
                else:
                    self._queue_of(block).append(block)
        for block in reversed(first):
            self._free_queue.appendleft(block)

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> Block | None:
        """The block of `group` stored under `block_hash`, or None. Does not touch it."""
        if not self.enable_caching:
            return None
        return self._cached.get((group, block_hash))

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every group-0 hash in the map now (what a KV-event subscriber resyncs to), in commit
        order."""
        return [block_hash for group, block_hash in self._cached if group == 0]

    def get_cached_children(self, parent_hash: BlockHash, group: int = 0) -> Iterable[Block]:
        """The mapped blocks whose parent hash is `parent_hash`, oldest commit first.

        O(1) to get, O(result) to iterate; does not touch them. Do not commit or evict while
        iterating.
        """
        return self._children.get((group, parent_hash), {}).values()

    def commit_block(
        self,
        block: Block,
        block_hash: BlockHash,
        parent_hash: BlockHash,
        token_ids: tuple[int, ...],
        extra_keys: ExtraKeys,
        group: int = 0,
    ) -> bool:
        """Publishes a full block of `group` whose KV has been computed, under `block_hash`.

        Returns:
            True if the block entered the map (BlockStored event, num_stored_blocks counted).
            False if caching is off or another block already holds that hash: stored once, this
            block stays private and unhashed and is simply freed later.
        """
        assert block.ref_count > 0, f"committing block {block.block_id} that nobody holds"
        if not self.enable_caching or (group, block_hash) in self._cached:
            return False
        block.set_committed(block_hash, parent_hash, token_ids, extra_keys, group)
        self._cached[(group, block_hash)] = block
        self._children.setdefault((group, parent_hash), {})[block.block_id] = block
        self._free_queue.note_commit((group, block_hash), block)
        self.num_stored_blocks += group == 0
        if self.enable_events and group == 0:
            self._events.append(
                BlockStored(
                    block_hashes=(block_hash,),
                    parent_block_hash=parent_hash,
                    token_ids=token_ids,
                    block_size=len(token_ids),
                    extra_keys=extra_keys,
                )
            )
        return True

    def reset_prefix_cache(self) -> tuple[bool, str]:
        """Forgets every hash, only when no block is held.

        Returns:
            (True, "") after clearing (AllBlocksCleared event), else (False, reason).
        """
        num_used = self.num_blocks - self.num_free_blocks
        if num_used > 0:
            return False, f"{num_used} blocks are still held by running requests"
        for block in self._cached.values():
            if block.retained_until:
                self._retained_free.remove(block)
                self._free_queue.append(block)
            block.retained_until, block.retained_by = 0.0, None
            block.reset_hash()
        self.retention.clear()
        self.misses.clear()
        self._cached.clear()
        self._free_queue.clear_history()
        self._children.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True, ""

    # ---- retention (retention.py) ------------------------------------------------------------

    def retain(
        self,
        block_hashes: Sequence[BlockHash],
        group: int,
        until: float,
        owner: str,
        max_owner_blocks: int,
    ) -> int:
        """Retains the cached blocks of `group` under `block_hashes` (a chain's prefix, in order)
        until `until` on the ledger's clock, or later if already retained longer.

        Group-0 blocks count against `owner`'s quota: the chain stops at the first block that
        would take the owner past `max_owner_blocks`. A block of another group is retained only
        where the group-0 block of its hash is retained (its quota pays for both). Missing
        (evicted or never cached) blocks are skipped. Returns how many blocks are retained for
        the owner by this call (new or refreshed).
        """
        self.expire_retention()
        counts, count = self.retention.owner_blocks, 0
        for block_hash in block_hashes:
            block = self._cached.get((group, block_hash))
            if block is None:
                continue
            if not block.retained_until:
                if group == 0:
                    if counts[owner] >= max_owner_blocks:
                        break
                    counts[owner] += 1
                else:
                    lead = self._cached.get((0, block_hash))
                    if lead is None or not lead.retained_until or lead.retained_by != owner:
                        continue
                if block.ref_count == 0:
                    self._free_queue.remove(block)
                    self._retained_free.append(block)
                block.retained_by, block.retention_lapsed = owner, False
                self.retention.push(until, block.block_id)
            elif block.retained_by != owner:
                continue  # another owner's retention pays for it
            block.retained_until = max(block.retained_until, until)
            count += 1
        return count

    @property
    def num_retained_blocks(self) -> int:
        """Group-0 blocks retained now, every owner's."""
        self.expire_retention()
        return sum(self.retention.owner_blocks.values())

    def retained_blocks(self, owner: str) -> int:
        """Group-0 blocks retained for `owner` now."""
        self.expire_retention()
        return self.retention.owner_blocks[owner]

    def is_retained(self, block_hash: BlockHash, owner: str) -> bool:
        """True if the group-0 block under `block_hash` is retained for `owner` now."""
        block = self._cached.get((0, block_hash))
        return block is not None and bool(block.retained_until) and block.retained_by == owner

    def expire_retention(self) -> None:
        """Ends every retention whose time has come: its block, if free, goes to the head of the
        eviction order (unused for the whole retention, it is the least recently used)."""
        for expiry, block_id in self.retention.due(self.retention.clock()):
            block = self.blocks[block_id]
            if block.retained_until > expiry:  # refreshed since: its entry goes back in
                self.retention.push(block.retained_until, block_id)
            elif block.retained_until:
                if block.ref_count == 0:
                    self._retained_free.remove(block)
                    self._free_queue.appendleft(block)
                self._end_retention(block)
                block.retention_lapsed = True

    def _end_retention(self, block: Block) -> None:
        """Forgets `block`'s retention (its heap entry goes stale); the caller moves it."""
        if block.retained_until:
            if block.group == 0:
                assert block.retained_by is not None
                self.retention.owner_blocks[block.retained_by] -= 1
            block.retained_until, block.retained_by = 0.0, None

    def take_events(self) -> list[KVEvent]:
        """Drains the events collected since the last call (always empty unless enable_events)."""
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Asserts the pool's invariants (module docstring); O(num_blocks)."""
        self._free_queue.check_links()
        self._retained_free.check_links()
        num_free = 0
        owners: dict[str, int] = {}
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            assert block.is_free == (block.ref_count == 0), (
                f"block {block.block_id}: ref_count {block.ref_count} but is_free {block.is_free}"
            )
            num_free += block.is_free
            if block.block_hash is not None:
                assert self._cached.get((block.group, block.block_hash)) is block, (
                    f"hashed block {block.block_id} is not the map's block for its hash"
                )
                assert block.token_ids is not None and block.parent_hash is not None
            else:
                assert block.token_ids is None and block.parent_hash is None and block.group == 0
            if block.retained_until:
                assert block.block_hash is not None and block.retained_by is not None, (
                    f"retained block {block.block_id} has no hash or owner"
                )
                if block.group == 0:
                    owners[block.retained_by] = owners.get(block.retained_by, 0) + 1
            else:
                assert block.retained_by is None, f"block {block.block_id} has a stale owner"
        assert all(b.retained_until for b in self._retained_free), "unretained block queued"
        assert not any(b.retained_until for b in self._free_queue), "retained block in the policy"
        assert owners == {o: n for o, n in self.retention.owner_blocks.items() if n}, (
            "retained blocks per owner disagree with the ledger"
        )
        assert num_free == self.num_free_blocks, "free count disagrees with the free queue"
        for (group, block_hash), block in self._cached.items():
            assert (block.group, block.block_hash) == (group, block_hash), (
                f"map entry points at block {block.block_id}"
            )
        num_hashed = sum(block.block_hash is not None for block in self.blocks)
        assert num_hashed == len(self._cached), "hashed blocks and map entries differ in number"
        num_children = 0
        for (group, parent_hash), children in self._children.items():
            assert children, "empty parent index entry"
            for block_id, block in children.items():
                assert block.block_id == block_id and block.parent_hash == parent_hash, (
                    f"parent index entry points at block {block.block_id}, not chained from it"
                )
                assert block.group == group and block.block_hash is not None, (
                    f"parent index holds block {block.block_id} under another group"
                )
                assert self._cached[(group, block.block_hash)] is block, (
                    f"parent index holds block {block.block_id}, which is not in the map"
                )
            num_children += len(children)
        assert num_children == len(self._cached), "parent index and map differ in size"
