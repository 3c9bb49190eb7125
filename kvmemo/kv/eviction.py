"""Eviction policies: the order in which the pool's free, unretained blocks are evicted.

A policy owns every free block that no retention holds (the block pool keeps retained ones in its
own queue). The pool tells it four things and asks one:
- append(block): the block's last reference was dropped (a request's blocks arrive last-first,
  so its tail is evicted before its shareable head); appendleft(block): the same, but the block
  is to go first (a retention ran out unused);
- remove(block): the block leaves the free set without being evicted (a hit took it, a
  retention took it, or partial reuse takes its slots);
- note_commit(key, block): a block was stored under (group, hash) `key`: a policy that remembers
  evicted keys (a ghost) learns here that an evicted block came back;
- clear_history(): the prefix cache was reset: every free block has lost its hash;
- popleft(): the next victim. The block still carries its hash when returned; the pool then
  unmaps it.
Blocks count their own reuses (Block.reuses, raised by every hit, zeroed when the block is
unmapped); a policy may lower the count it reads (S3-FIFO's second chances).

Every operation is O(1) amortised. Policies by name: `EVICTION_POLICIES`; the pool checks a
policy's structure with check_links() in its invariant checker.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from typing import Protocol

from kvmemo.kv.block import Block
from kvmemo.kv.free_queue import FreeBlockQueue
from kvmemo.kv.hashing import BlockHash

GhostKey = tuple[int, BlockHash]  # (layer group, block hash)


class EvictionPolicy(Protocol):
    name: str

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Block]: ...
    def append(self, block: Block) -> None: ...
    def appendleft(self, block: Block) -> None: ...
    def remove(self, block: Block) -> None: ...
    def popleft(self) -> Block: ...
    def note_commit(self, key: GhostKey, block: Block) -> None: ...
    def clear_history(self) -> None: ...
    def check_links(self) -> None: ...


class LRUPolicy(FreeBlockQueue[Block]):
    """Least recently freed first: one intrusive queue (the pool's order before policies)."""

    name = "lru"

    def note_commit(self, key: GhostKey, block: Block) -> None:
        pass

    def clear_history(self) -> None:
        pass


class Ghost:
    """Keys of recently evicted blocks (or store entries), oldest first, at most `capacity` (a
    bounded FIFO set)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def take(self, key: Hashable) -> bool:
        """True (and forgets it) if `key` was evicted recently."""
        return self._keys.pop(key, 0) is None

    def clear(self) -> None:
        self._keys.clear()


class SegmentedQueues:
    """Three intrusive queues of free blocks, a block's `segment` naming the one it is in: blocks
    without a hash (never committed, or unmapped), blocks never reused, and reused blocks.

    Blocks without a hash carry nothing a later request could hit, so every segmented policy
    evicts them first; the policy chooses between the other two.
    """

    EMPTY, NEW, REUSED = 0, 1, 2

    def __init__(self, blocks: Iterable[Block]) -> None:
        self.segments: list[FreeBlockQueue[Block]] = [FreeBlockQueue() for _ in range(3)]
        for block in blocks:
            self.push(block, self.EMPTY)

    def append(self, block: Block) -> None:
        self.push(block, self._segment_of(block))

    def appendleft(self, block: Block) -> None:
        self.push(block, self._segment_of(block), first=True)

    def _segment_of(self, block: Block) -> int:
        if block.block_hash is None:
            return self.EMPTY
        return self.REUSED if block.reuses > 0 else self.NEW

    def __len__(self) -> int:
        return sum(len(queue) for queue in self.segments)

    def __iter__(self) -> Iterator[Block]:
        """Blocks segment by segment, each head first (not the exact eviction order)."""
        for queue in self.segments:
            yield from queue

    def push(self, block: Block, segment: int, first: bool = False) -> None:
        block.segment = segment
        queue = self.segments[segment]
        if first:
            queue.appendleft(block)
        else:
            queue.append(block)

    def remove(self, block: Block) -> None:
        self.segments[block.segment].remove(block)

    def regroup_unhashed(self) -> None:
        """Moves blocks that lost their hash (the prefix cache was reset) to the empty segment,
        in their order: O(free blocks), for a reset only."""
        for queue in self.segments[self.EMPTY + 1:]:
            for block in [block for block in queue if block.block_hash is None]:
                queue.remove(block)
                self.push(block, self.EMPTY)

    def check_links(self) -> None:
        for segment, queue in enumerate(self.segments):
            queue.check_links()
            assert all(block.segment == segment for block in queue), "block in a wrong segment"
            if segment != self.EMPTY:
                assert all(block.block_hash is not None for block in queue), (
                    "a block without a hash outside the empty segment"
                )


def _key(block: Block) -> GhostKey:
    assert block.block_hash is not None
    return (block.group, block.block_hash)


class S3FIFOPolicy(SegmentedQueues):
    """S3-FIFO (Yang et al., SOSP'23) over free blocks: a small FIFO for blocks never reused, a
    main FIFO for reused ones, and a ghost of keys evicted from the small queue.

    A freed block that was never hit enters the small queue; the main queue takes blocks hit at
    least once, and blocks whose key the ghost remembers (they were evicted too early). The
    small queue is evicted while it holds more than `small_fraction` of the free blocks; a main
    block still carrying reuses gets another round (its count lowered by one) instead.
    """

    name = "s3fifo"

    def __init__(self, blocks: list[Block], small_fraction: float = 0.1) -> None:
        super().__init__(blocks)
        self.small_fraction = small_fraction
        self.ghost = Ghost(len(blocks))

    def popleft(self) -> Block:
        empty, small, main = self.segments
        if len(empty):
            return empty.popleft()
        if len(small) and (not len(main) or len(small) > self.small_fraction * len(self)):
            block = small.popleft()
            self.ghost.add(_key(block))
            return block
        while True:  # terminates: every round lowers a count, and counts are capped at 3
            block = main.popleft()
            if block.reuses <= 0:
                return block
            block.reuses = min(block.reuses, 3) - 1
            main.append(block)

    def note_commit(self, key: GhostKey, block: Block) -> None:
        if self.ghost.take(key):
            block.reuses = 1  # evicted too early: it goes to the main queue when freed

    def clear_history(self) -> None:
        self.ghost.clear()
        self.regroup_unhashed()


class ARCPolicy(SegmentedQueues):
    """ARC (Megiddo and Modha, FAST'03) over free blocks: T1 holds blocks never reused, T2 reused
    ones; ghosts B1 and B2 remember what each evicted, and a ghost hit moves the target size of
    T1 (up for a B1 hit, down for a B2 hit), so the split between recency and frequency follows
    the workload instead of a constant. A block whose key a ghost remembers was evicted too
    early: recomputed, it counts as reused (T2 when freed). Only free blocks are counted against
    the target: blocks in use are not evictable whatever their list.

    Why ghosts of 4x the pool, not ARC's 1x: a conversation's next turn comes minutes later
    (Mooncake's trace: median 114 s), long after a small pool has evicted the turn before; a
    ghost that remembers it tells the returning conversation from a one-off prompt, whose
    blocks (76% of that trace's) then go first. On that trace, at 0.5M / 1M / 3M / 10M / 50M
    tokens: ghosts of 1x reach 1.28 / 1.49 / 1.14 / 1.02 / 1.00x LRU's hit ratio, 4x 1.70 /
    1.73 / 1.17 / 1.04 / 1.00x (docs/benchmarks.md). Bounded: at most 2 x 2^18 keys (about
    120 MiB for a pool past 64Ki blocks; 2 x 4 x 4,096 keys, 7 MiB, for a 4,096-block pool).
    """

    GHOST_FACTOR = 4
    MAX_GHOST_KEYS = 1 << 18

    name = "arc"

    def __init__(self, blocks: list[Block]) -> None:
        super().__init__(blocks)
        self.capacity = len(blocks)
        self.target_t1 = 0.0
        ghost_keys = int(min(self.GHOST_FACTOR * self.capacity, self.MAX_GHOST_KEYS))
        self.b1 = Ghost(ghost_keys)
        self.b2 = Ghost(ghost_keys)

    def popleft(self) -> Block:
        empty, t1, t2 = self.segments
        if len(empty):
            return empty.popleft()
        if len(t1) and (not len(t2) or self._t1_goes_first()):
            block = t1.popleft()
            self.b1.add(_key(block))
        else:
            block = t2.popleft()
            self.b2.add(_key(block))
        return block

    def _t1_goes_first(self) -> bool:
        """With both lists non-empty: is T1's head the victim?"""
        return len(self.segments[self.NEW]) > self.target_t1

    def note_commit(self, key: GhostKey, block: Block) -> None:
        if self.b1.take(key):
            step = max(1.0, len(self.b2) / max(1, len(self.b1)))
            self.target_t1 = min(float(self.capacity), self.target_t1 + step)
            block.reuses = 1
        elif self.b2.take(key):
            step = max(1.0, len(self.b1) / max(1, len(self.b2)))
            self.target_t1 = max(0.0, self.target_t1 - step)
            block.reuses = 1

    def clear_history(self) -> None:
        self.b1.clear()
        self.b2.clear()
        self.target_t1 = 0.0
        self.regroup_unhashed()


class Favour:
    """aged-arc's one learned number: how many times less a reused entry's age counts against a
    never-reused one's when choosing the victim. A ghost hit on a reused entry (B2: reuse was
    evicted too early) raises it by 1%; one on a never-reused entry (B1) lowers it by 0.3%, never
    below 1, where the choice is LRU's exactly. Shared by the pool's policy and the store tiers'
    (kvmemo/kv/keyed_eviction.py), so both learn by one rule.

    Why B2 hits weigh about 3x B1 hits: a reused block is a conversation past its first turn, and
    those come back more often (in Mooncake's trace 42-75% of later turns get a next one, 31% of
    first turns), so evicting one too early costs more; with equal steps the policy gains half
    as much below 3M tokens (docs/benchmarks.md).
    """

    STEP_UP = 1.01  # on a B2 ghost hit
    STEP_DOWN = 1.003  # on a B1 ghost hit
    MAX_FAVOUR = 64.0

    def __init__(self) -> None:
        self.value = 1.0

    def new_goes_first(self, age_new: int, age_reused: int) -> bool:
        """With a never-reused and a reused candidate, each `age` ticks old: is the first the
        victim?"""
        return self.value * age_new >= age_reused

    def reused_evicted_too_early(self) -> None:
        self.value = min(self.MAX_FAVOUR, self.value * self.STEP_UP)

    def new_evicted_too_early(self) -> None:
        self.value = max(1.0, self.value / self.STEP_DOWN)

    def reset(self) -> None:
        self.value = 1.0


class AgedARCPolicy(ARCPolicy):
    """ARC's two lists and ghosts, with LRU's victim: the older of the two heads, where a reused
    block's age counts `favour` times less (Favour: learned from the ghosts' hits, starting at
    1, where the policy is LRU exactly, and leaving it only on evidence).

    Why not ARC's size target: ARC keeps T2 (reused blocks) large whatever their age, and on
    Mooncake's trace loses to LRU from 15M tokens up (0.320 against 0.331 at 15M, 0.334 against
    0.358 at 20M), where LRU already holds a conversation until its next turn. Comparing ages
    keeps LRU's order where LRU is right, and gives reused blocks longer only as far as the
    ghosts show that it pays. Ages are counted in frees (a logical clock), so there is no time
    constant to tune.
    """

    name = "aged-arc"

    def __init__(self, blocks: list[Block]) -> None:
        super().__init__(blocks)
        self.favour = Favour()
        self.clock = 0
        self.freed_at = [0] * len(blocks)  # per block id, the clock when it was last freed

    def append(self, block: Block) -> None:
        self.clock += 1
        self.freed_at[block.block_id] = self.clock
        super().append(block)

    def appendleft(self, block: Block) -> None:
        self.freed_at[block.block_id] = 0  # to go first: the oldest possible
        super().appendleft(block)

    def _t1_goes_first(self) -> bool:
        new, reused = self.segments[self.NEW].peek(), self.segments[self.REUSED].peek()
        assert new is not None and reused is not None
        return self.favour.new_goes_first(self.clock - self.freed_at[new.block_id],
                                          self.clock - self.freed_at[reused.block_id])

    def note_commit(self, key: GhostKey, block: Block) -> None:
        if self.b1.take(key):
            self.favour.new_evicted_too_early()
            block.reuses = 1
        elif self.b2.take(key):
            self.favour.reused_evicted_too_early()
            block.reuses = 1

    def clear_history(self) -> None:
        super().clear_history()
        self.favour.reset()


EVICTION_POLICIES = ("lru", "aged-arc", "arc", "s3fifo")
DEFAULT_EVICTION_POLICY = "aged-arc"


def make_eviction_policy(name: str, blocks: list[Block]) -> EvictionPolicy:
    """The policy `name` over `blocks`, all free (the order they are given in is LRU's)."""
    if name == "lru":
        return LRUPolicy(blocks)
    if name == "s3fifo":
        return S3FIFOPolicy(blocks)
    if name == "arc":
        return ARCPolicy(blocks)
    if name == "aged-arc":
        return AgedARCPolicy(blocks)
    raise ValueError(f"eviction policy must be one of {list(EVICTION_POLICIES)}, got {name!r}")
