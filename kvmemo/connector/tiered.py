"""TieredStore: several BlockStores as one (e.g. disk, then Redis).

Blocks are looked up in order and saved to all.

Invariant: get_many serves each block of a consecutive prefix from the first tier that has it,
and only the consecutive prefix (a block after a miss is useless to a prefix match); a block
served by a lower tier is copied into the tiers above it, so the next lookup is faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from kvmemo.connector.store import BlockStore, StoreStats, get_many
from kvmemo.kv.hashing import BlockHash


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier: blocks it served to the connector, and its own store counters."""

    name: str
    served_blocks: int
    store: StoreStats
    num_errors: int  # failed calls (connection lost); 0 for stores that cannot lose one


class TieredStore:
    """Owns the tiers (fastest first) and the per-tier served counters."""

    kind = "tiered"

    def __init__(self, tiers: Sequence[tuple[str, BlockStore]]) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        names = [name for name, _ in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers = list(tiers)
        self._served = [0] * len(tiers)

    def get(self, block_hash: BlockHash) -> bytes | None:
        return self.get_many([block_hash])[0]

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """The longest prefix of block_hashes found tier by tier; None from the first miss on."""
        out: list[bytes | None] = [None] * len(block_hashes)
        start = 0  # blocks [0, start) are found
        for t, (_, store) in enumerate(self.tiers):
            if start == len(block_hashes):
                break
            found = get_many(store, block_hashes[start:])
            for payload in found:
                if payload is None:
                    break
                out[start] = payload
                for _, upper in self.tiers[:t]:  # promote: the faster tiers missed it
                    upper.put(block_hashes[start], payload)
                self._served[t] += 1
                start += 1
        return out

    def put(self, block_hash: BlockHash, payload: bytes) -> None:
        """Queues the save with every tier that does not have the block yet."""
        for _, store in self.tiers:
            if not store.contains(block_hash):
                store.put(block_hash, payload)

    def contains(self, block_hash: BlockHash) -> bool:
        """Every tier has it (so a save can be skipped)."""
        return all(store.contains(block_hash) for _, store in self.tiers)

    def flush(self) -> None:
        for _, store in self.tiers:
            store.flush()

    def close(self) -> None:
        for _, store in self.tiers:
            close = getattr(store, "close", None)
            if close is not None:
                close()

    @property
    def stats(self) -> StoreStats:
        """Every tier's counters summed."""
        totals = {f.name: 0 for f in fields(StoreStats)}
        for _, store in self.tiers:
            s = store.stats
            for name in totals:
                totals[name] += getattr(s, name)
        return StoreStats(**totals)

    def tier_stats(self) -> list[TierStats]:
        return [
            TierStats(name, served, store.stats, getattr(store, "num_errors", 0))
            for (name, store), served in zip(self.tiers, self._served)
        ]
