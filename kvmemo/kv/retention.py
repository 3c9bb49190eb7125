"""Retention: a prompt prefix's KV kept cached for a while after its last use, within a quota.

What the agent APIs' cache hints become (Anthropic's `cache_control` breakpoints with their
`ttl`, OpenAI's `prompt_cache_retention`): a request carries Retention ranges; when it ends, the
blocks of each range are retained until `seconds` from then (a later request using them again
refreshes that). A free retained block is evicted only when no other free block is left, so a
retained prefix survives a flood of other traffic for its duration, and the pool can never be
held: under that much pressure it is evicted (counted) rather than refusing work.

The ledger keeps the books: each retained block's expiry in a heap (one entry per block; a
refreshed block's entry is pushed again when its old time comes), and the retained group-0
blocks per owner (the request's cache_salt), which the per-owner quota bounds.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_OWNER = ""  # the owner of requests without a cache_salt


@dataclass(frozen=True, slots=True)
class Retention:
    """Keep the KV of the prompt's first `num_tokens` tokens (its full blocks) cached for
    `seconds` after the request ends."""

    num_tokens: int
    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or (
            self.num_tokens < 0
        ):
            raise ValueError(f"retention num_tokens must be an integer >= 0, "
                             f"got {self.num_tokens!r}")
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) or not (
            math.isfinite(self.seconds) and self.seconds > 0
        ):
            raise ValueError(f"retention seconds must be a finite number > 0, "
                             f"got {self.seconds!r}")


def retained_tokens(ranges: tuple[Retention, ...]) -> int:
    """How many leading prompt tokens the ranges cover together (the longest range)."""
    return max((r.num_tokens for r in ranges), default=0)


class RetentionLedger:
    """Expiry times and per-owner counts of retained blocks; the pool moves the blocks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int]] = []  # (expiry, block_id), one per retained block
        self.owner_blocks: Counter[str] = Counter()  # group-0 retained blocks per owner

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, expiry: float, block_id: int) -> None:
        heapq.heappush(self._heap, (expiry, block_id))

    def due(self, now: float) -> list[tuple[float, int]]:
        """Pops every entry whose time has come, oldest first."""
        popped: list[tuple[float, int]] = []
        while self._heap and self._heap[0][0] <= now:
            popped.append(heapq.heappop(self._heap))
        return popped

    def clear(self) -> None:
        self._heap.clear()
        self.owner_blocks.clear()

