"""MissLedger: what explaining a miss (miss_causes.py) needs once the pool forgot it, bounded.

It remembers, oldest forgotten first, which hashes left the pool and how (evicted, or evicted
after their retention ran out), and which cache_salts stored each token chain (keys over the
tokens alone, so that another tenant's copy of the same tokens is found). MissReport is one
request's explanation.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvmemo.kv.hashing import BlockHash

CAUSES = ("cache_skipped", "last_token", "evicted", "expired_retention", "template_drift",
          "diverged", "other_salt", "never_seen", "partial_tail")
_MAX_SIBLINGS = 64  # cached blocks compared when looking for where a prompt diverged


@dataclass(frozen=True, slots=True)
class MissReport:
    """A request's uncached prompt tokens by cause (only causes with tokens), and where it left
    a cached chain."""

    tokens: dict[str, int] = field(default_factory=dict)
    diverged_at: int | None = None  # token index, for a `diverged` miss
    eviction_policy: str = "lru"  # the pool's (eviction.py), which the `evicted` count names

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens.values())

    def for_the_client(self) -> dict[str, int]:
        """The causes a request's own answer may carry: other_salt counts as never_seen there,
        since telling one tenant that another cached the same tokens would leak that tenant's
        prompt (what cache_salt prevents); the server's aggregate counters keep it."""
        tokens = dict(self.tokens)
        if "other_salt" in tokens:
            tokens["never_seen"] = tokens.get("never_seen", 0) + tokens.pop("other_salt")
        return tokens


def chain_keys(token_ids: Sequence[int], block_size: int, num_blocks: int,
               keys: list[bytes]) -> list[bytes]:
    """Extends `keys` (one per full block, over the tokens alone, chained) to `num_blocks`.
    BLAKE2b, not Python's per-process seeded hash: deterministic across processes and not
    collidable on purpose (a crafted collision would make one tenant's miss report another's
    tokens as other_salt)."""
    key = keys[-1] if keys else b""
    for index in range(len(keys), num_blocks):
        block = token_ids[index * block_size : (index + 1) * block_size]
        key = hashlib.blake2b(key + array("q", block).tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


class CommittedRequest(Protocol):
    """What note_committed reads of a request (kvmemo.request.Request)."""

    all_token_ids: list[int]
    token_keys: list[bytes]
    block_hashes: list[BlockHash]
    cache_salt: str | None

    @property
    def num_prompt_tokens(self) -> int: ...


class MissLedger:
    """What a miss needs to be explained once the pool forgot it (module doc), bounded."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._left: OrderedDict[BlockHash, str] = OrderedDict()  # hash -> evicted / expired_...
        self._salts: OrderedDict[bytes, frozenset[str | None]] = OrderedDict()  # chain key -> salts
        # hash of a block holding generated tokens -> the offset of its first generated token
        self._generated: OrderedDict[BlockHash, int] = OrderedDict()
        self.totals: Counter[str] = Counter()  # uncached prompt tokens by cause, cumulative

    def note_evicted(self, block_hash: BlockHash, retention_lapsed: bool) -> None:
        self._remember(self._left, block_hash, "expired_retention" if retention_lapsed
                       else "evicted")

    def note_committed(self, request: CommittedRequest, start: int, end: int, size: int) -> None:
        """Blocks start..end of `request` were committed: their token chains under its salt,
        and which of them hold generated tokens (a later prompt diverging there re-rendered a
        reply: template drift)."""
        if end <= start:
            return
        keys = chain_keys(request.all_token_ids, size, end, request.token_keys)
        self.note_stored(keys[start:end], request.cache_salt)
        for index in range(max(start, request.num_prompt_tokens // size), end):
            offset = max(0, request.num_prompt_tokens - index * size)
            self._remember(self._generated, request.block_hashes[index], offset)

    def generated_from(self, block_hash: BlockHash) -> int | None:
        """The offset in the block of its first generated token, if it holds any."""
        return self._generated.get(block_hash)

    def _remember(self, table: OrderedDict, key: object, value: object) -> None:
        table[key] = value
        table.move_to_end(key)
        if len(table) > self.capacity:
            table.popitem(last=False)

    def note_stored(self, keys: Iterable[bytes], salt: str | None) -> None:
        for key in keys:
            salts = self._salts.get(key, frozenset())
            self._remember(self._salts, key, salts | {salt})

    def how_it_left(self, block_hash: BlockHash) -> str | None:
        return self._left.get(block_hash)

    def stored_by_another(self, key: bytes, salt: str | None) -> bool:
        return bool(self._salts.get(key, frozenset()) - {salt})

    def record(self, report: MissReport) -> None:
        self.totals.update(report.tokens)

    def clear(self) -> None:
        self._left.clear()
        self._salts.clear()
        self._generated.clear()
