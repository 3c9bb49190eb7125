"""Routing policies: which replica gets a prompt, from its block hashes and the replicas' state.

Invariant: only candidates (healthy replicas) are chosen; "prefix" picks the longest cached
prefix unless that replica is more than balance_threshold requests busier than the least loaded
one; ties and cold prompts go to the least loaded, rotating among equals so they spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("prefix", "round_robin")


@dataclass(frozen=True, slots=True)
class Candidate:
    """What a policy sees of one healthy replica."""

    index: int  # position in the router's replica list
    matched_blocks: int  # longest prefix of the prompt's blocks it holds
    in_flight: int  # requests the router has sent it that have not finished


@dataclass(frozen=True, slots=True)
class Decision:
    index: int
    matched_blocks: int
    reason: str  # "prefix", "cold", "balance" or "round_robin"


class RoutingPolicy:
    """Owns the rotation counter that spreads ties; `choose` is otherwise a pure function."""

    def __init__(self, policy: str = "prefix", balance_threshold: int = 4) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
        if not isinstance(balance_threshold, int) or balance_threshold < 0:
            raise ValueError(
                f"balance_threshold must be an integer >= 0, got {balance_threshold!r}"
            )
        self.policy = policy
        self.balance_threshold = balance_threshold
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        """Raises ValueError when there is no candidate."""
        if not candidates:
            raise ValueError("no healthy replica to route to")
        self._turn += 1
        if self.policy == "round_robin":
            pick = candidates[self._turn % len(candidates)]
            return Decision(pick.index, pick.matched_blocks, "round_robin")
        least_load = min(c.in_flight for c in candidates)
        best_match = max(c.matched_blocks for c in candidates)
        if best_match > 0:
            holders = [c for c in candidates if c.matched_blocks == best_match]
            pick = self._least_loaded(holders)
            if pick.in_flight - least_load <= self.balance_threshold:
                return Decision(pick.index, pick.matched_blocks, "prefix")
            pick = self._least_loaded(candidates)
            return Decision(pick.index, pick.matched_blocks, "balance")
        pick = self._least_loaded(candidates)
        return Decision(pick.index, 0, "cold")

    def _least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        least = min(c.in_flight for c in candidates)
        tied = [c for c in candidates if c.in_flight == least]
        return tied[self._turn % len(tied)]
