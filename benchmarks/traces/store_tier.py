"""A persistent KV store tier behind the replayed pool (a disk or Redis tier, capacity-bounded),
and what it admits: every computed block, as kvmemo's connector writes today, or only blocks
with a second sighting.

Invariant: the store holds at most `capacity_blocks` ids, evicting by the pool's policy in its
keyed form (kvmemo/kv/keyed_eviction.py: `lru`, least recently written or read first, or
`aged-arc`, a read entry's age counting less); a request reads a run of consecutive blocks after
its device hit, and the blocks it then computes are offered for writing. Tail-first within a chain: a
request's blocks are written and refreshed last to first, so its head, which every longer
prompt on the chain needs, is evicted last.

Admission "reused" (TinyLFU's doorkeeper, as vLLM's CPU tier stores a block only once seen
twice): a computed block is written only if its id was computed before (it came back after the
device evicted it); a block hit on the device is written when first hit (its reuse is proven).
The doorkeeper remembers `doorkeeper_blocks` ids, oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvmemo.kv.keyed_eviction import KEYED_POLICIES, make_keyed_eviction

ADMISSIONS = ("all", "reused")


@dataclass
class StoreCounters:
    read_blocks: int = 0  # blocks served from the store
    written_blocks: int = 0
    evicted_blocks: int = 0


class StoreTier:
    def __init__(self, capacity_blocks: int, admission: str = "all",
                 doorkeeper_blocks: int | None = None, eviction: str = "lru") -> None:
        if admission not in ADMISSIONS:
            raise ValueError(f"store admission must be one of {list(ADMISSIONS)}, "
                             f"got {admission!r}")
        if eviction not in KEYED_POLICIES:
            raise ValueError(f"store eviction must be one of {list(KEYED_POLICIES)}, "
                             f"got {eviction!r}")
        if capacity_blocks < 1:
            raise ValueError(f"store capacity must be >= 1 block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.admission = admission
        self.doorkeeper_blocks = doorkeeper_blocks or 4 * capacity_blocks
        self._blocks = make_keyed_eviction(eviction, capacity_blocks)
        self._seen: OrderedDict[int, None] = OrderedDict()
        self.counters = StoreCounters()

    def read_run(self, hash_ids: Sequence[int]) -> int:
        """How many of `hash_ids`, from the first, the store holds (each read refreshes it)."""
        count = 0
        while count < len(hash_ids) and hash_ids[count] in self._blocks:
            count += 1
        for hash_id in reversed(hash_ids[:count]):
            self._blocks.touch(hash_id)
        self.counters.read_blocks += count
        return count

    def device_hits(self, hash_ids: Sequence[int]) -> None:
        """Blocks the device served: under "reused", their reuse is proven, so they are written."""
        if self.admission == "reused":
            for hash_id in reversed(hash_ids):
                if hash_id not in self._blocks:
                    self._write(hash_id)

    def computed(self, hash_ids: Sequence[int]) -> None:
        """Blocks the request computed, offered for writing (last first)."""
        for hash_id in reversed(hash_ids):
            if hash_id in self._blocks:
                self._blocks.insert(hash_id)  # rewritten: refreshed
            elif self.admission == "all" or self._seen_before(hash_id):
                self._write(hash_id)

    def _seen_before(self, hash_id: int) -> bool:
        if hash_id in self._seen:
            del self._seen[hash_id]
            return True
        self._seen[hash_id] = None
        if len(self._seen) > self.doorkeeper_blocks:
            self._seen.popitem(last=False)
        return False

    def _write(self, hash_id: int) -> None:
        self._blocks.insert(hash_id)
        self.counters.written_blocks += 1
        if len(self._blocks) > self.capacity_blocks:
            self._blocks.pop_victim()
            self.counters.evicted_blocks += 1
