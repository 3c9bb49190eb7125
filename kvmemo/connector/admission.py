"""Which committed blocks the KV store writes: every one ("all"), or only those seen twice
("reused": TinyLFU's doorkeeper; vLLM's CPU tier stores a block only once seen twice).

Under "reused", a block is written when a request hits it in the device pool (its reuse is
proven) or when it is committed a second time (the pool evicted it and it came back); a block
committed once and never hit is not written. Why an option, not the default: on Mooncake's
trace (docs/benchmarks.md) a store under pressure (5M tokens behind a 1M-token pool) keeps its
hit ratio with "reused" (0.104 against 0.105) while writing 5.3x fewer bytes per hit token, but
a store with room (20M and more) loses half its hits (0.114 against 0.252): a conversation's
second turn, the trace's most common reuse, finds its first turn only if it was written.

Invariant: the doorkeeper remembers at most `doorkeeper_blocks` hashes, oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvmemo.kv.hashing import BlockHash

STORE_ADMISSIONS = ("all", "reused")


class StoreAdmission:
    def __init__(self, admission: str = "all", doorkeeper_blocks: int = 1 << 16) -> None:
        if admission not in STORE_ADMISSIONS:
            raise ValueError(
                f"kv_store_admission must be one of {list(STORE_ADMISSIONS)}, got {admission!r}"
            )
        self.admission = admission
        self.doorkeeper_blocks = doorkeeper_blocks
        self._seen: OrderedDict[BlockHash, None] = OrderedDict()
        self._reused: dict[BlockHash, None] = {}  # device hits to write, in order
        self.num_declined = 0  # committed blocks not written (seen once)

    def admit_committed(self, block_hash: BlockHash) -> bool:
        """Whether a block committed now is written."""
        if self.admission == "all":
            return True
        if self._seen.pop(block_hash, 0) is None:
            return True  # committed before: it came back after an eviction
        self._seen[block_hash] = None
        if len(self._seen) > self.doorkeeper_blocks:
            self._seen.popitem(last=False)
        self.num_declined += 1
        return False

    def note_device_hits(self, block_hashes: Iterable[BlockHash]) -> None:
        """Blocks a request found in the device pool: under "reused", written at the next save."""
        if self.admission == "reused":
            for block_hash in block_hashes:
                self._reused[block_hash] = None

    def take_reused(self) -> list[BlockHash]:
        reused, self._reused = list(self._reused), {}
        return reused
