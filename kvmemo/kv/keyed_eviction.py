"""The pool's eviction policies for a store tier: entries named by key, not pool blocks.

A disk or Redis tier behind the pool holds blocks by hash, each written once and read by later
requests. The same rule that orders the pool's free blocks orders its entries, so a tier evicts
what the pool would: `lru` (least recently written or read first) and `aged-arc` (the pool's
default: entries never read and entries read at least once in two queues, the victim the older
head with a read entry's age counting Favour times less, learned from ghosts of evicted keys).
The pool's other policies (arc, s3fifo) have no keyed form; a tier behind them uses `lru`.

The tier tells the policy three things and asks one: insert(key) (written), touch(key) (read,
or rewritten), discard(key) (gone without an eviction: a bad or vanished file), pop_victim().
Tail-first within a chain comes from the caller: a request's blocks are written last first, so
a chain's head, which every longer prompt on it needs, is the most recent and evicted last.
Every operation is O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol

from kvmemo.kv.eviction import ARCPolicy, Favour, Ghost

KEYED_POLICIES = ("lru", "aged-arc")


class KeyedEviction(Protocol):
    name: str

    def __len__(self) -> int: ...
    def __contains__(self, key: Hashable) -> bool: ...
    def insert(self, key: Hashable) -> None: ...
    def touch(self, key: Hashable) -> None: ...
    def discard(self, key: Hashable) -> None: ...
    def pop_victim(self) -> Hashable: ...


class KeyedLRU:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    touch = insert

    def discard(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> Hashable:
        return self._order.popitem(last=False)[0]


class KeyedAgedARC:
    """aged-arc over keys: `fresh` holds entries never read since written, `read` entries read
    at least once, each least recent first with the clock of its last use; ghosts remember the
    keys each queue evicted, at most `ghost_keys` each (the pool's 4x its size)."""

    name = "aged-arc"

    def __init__(self, ghost_keys: int) -> None:
        self.fresh: OrderedDict[Hashable, int] = OrderedDict()
        self.read: OrderedDict[Hashable, int] = OrderedDict()
        self.b1 = Ghost(ghost_keys)  # evicted from fresh
        self.b2 = Ghost(ghost_keys)  # evicted from read
        self.favour = Favour()
        self.clock = 0

    def __len__(self) -> int:
        return len(self.fresh) + len(self.read)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.fresh or key in self.read

    def insert(self, key: Hashable) -> None:
        """Written. A key a ghost remembers was evicted too early: it comes back as read."""
        if key in self:
            self.touch(key)
            return
        self.clock += 1
        if self.b1.take(key):
            self.favour.new_evicted_too_early()
            self.read[key] = self.clock
        elif self.b2.take(key):
            self.favour.reused_evicted_too_early()
            self.read[key] = self.clock
        else:
            self.fresh[key] = self.clock

    def touch(self, key: Hashable) -> None:
        self.clock += 1
        self.fresh.pop(key, None)
        self.read.pop(key, None)
        self.read[key] = self.clock

    def discard(self, key: Hashable) -> None:
        self.fresh.pop(key, None)
        self.read.pop(key, None)

    def pop_victim(self) -> Hashable:
        if not self.read or (self.fresh and self._fresh_goes_first()):
            key, _ = self.fresh.popitem(last=False)
            self.b1.add(key)
        else:
            key, _ = self.read.popitem(last=False)
            self.b2.add(key)
        return key

    def _fresh_goes_first(self) -> bool:
        fresh_at = next(iter(self.fresh.values()))
        read_at = next(iter(self.read.values()))
        return self.favour.new_goes_first(self.clock - fresh_at, self.clock - read_at)


def make_keyed_eviction(pool_policy: str, capacity_entries: int) -> KeyedEviction:
    """The keyed form of the pool's policy `pool_policy` for a tier of about `capacity_entries`
    entries (its ghosts sized as the pool's are: 4x, at most ARCPolicy.MAX_GHOST_KEYS)."""
    if pool_policy == "aged-arc":
        ghost_keys = int(min(ARCPolicy.GHOST_FACTOR * max(1, capacity_entries),
                             ARCPolicy.MAX_GHOST_KEYS))
        return KeyedAgedARC(ghost_keys)
    return KeyedLRU()
