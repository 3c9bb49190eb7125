"""EngineStats and KVInfo: what an engine tells the outside about itself, as typed values.

Invariant: both are frozen snapshots built by the Engine between steps; readers (the server's
metrics, the CLI, benchmarks, a router) never reach into the engine's parts for these numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmemo.connector.tiered import TieredStore
from kvmemo.kv.miss_ledger import CAUSES

if TYPE_CHECKING:
    from kvmemo.connector.store_connector import StoreKVConnector
    from kvmemo.engine.encoder_cache import EncoderCache
    from kvmemo.engine.scheduler import Scheduler
    from kvmemo.kv.hybrid import AnyKVCacheManager


@dataclass(frozen=True, slots=True)
class StoreTierStats:
    """One KV store tier: blocks it served, blocks it lacked, failed calls."""

    name: str
    served_blocks: int
    miss_blocks: int
    errors: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters since the engine started, and its queue and pool right now."""

    num_steps: int
    num_preemptions: int
    num_running: int  # sequences holding KV blocks
    num_waiting: int  # sequences waiting for admission (the queue depth)
    kv_num_blocks: int
    kv_num_free_blocks: int  # free blocks, cached ones included
    kv_usage: float  # fraction of blocks referenced by sequences
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    prefix_cache_partial_hit_tokens: int
    prefix_cache_hit_rate: float
    prefix_cache_evicted_blocks: int
    prefix_cache_stored_blocks: int
    # Retention (kv/retention.py): blocks retained now (every tenant; the full-attention group),
    # and retained blocks evicted before their time because nothing else was free (cumulative)
    retained_blocks: int = 0
    retained_evicted_blocks: int = 0
    # Uncached prompt tokens by cause (kv/miss_causes.py), cumulative: every cause, in CAUSES order
    uncached_tokens_by_cause: tuple[tuple[str, int], ...] = ()
    # The persistent KV store (all zero and no tiers without --kv-store).
    store_hit_tokens: int = 0
    store_miss_tokens: int = 0
    store_bytes_read: int = 0
    store_bytes_written: int = 0
    store_load_s: float = 0.0
    store_save_s: float = 0.0
    store_saves_dropped: int = 0
    store_tiers: tuple[StoreTierStats, ...] = ()
    # The image encoder cache (all zero for text-only models).
    mm_encoder_images: int = 0
    mm_encoder_calls: int = 0
    mm_encoder_cache_hits: int = 0
    mm_encoder_cache_bytes: int = 0

    def as_dict(self) -> dict[str, float | int]:
        """Flat name -> number (JSON output, logs); tier counters as store_tier_<name>_<key>."""
        flat: dict[str, float | int] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("store_tiers", "uncached_tokens_by_cause")
        }
        for cause, count in self.uncached_tokens_by_cause:
            flat[f"uncached_tokens_{cause}"] = count
        for tier in self.store_tiers:
            flat[f"store_tier_{tier.name}_served_blocks"] = tier.served_blocks
            flat[f"store_tier_{tier.name}_miss_blocks"] = tier.miss_blocks
            flat[f"store_tier_{tier.name}_errors"] = tier.errors
        return flat


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Where an engine's memory goes, in bytes."""

    weights_bytes: int  # the model's tensors as held: plain weights, packed kernel copies
    kv_pool_bytes: int  # the paged KV pool's size (on CPU resident only as blocks fill)
    peak_rss_bytes: int  # the process's peak resident set so far (0 where unknown)


@dataclass(frozen=True, slots=True)
class KVInfo:
    """How this engine names KV blocks: what a router needs to hash prompts the same way."""

    weights_fingerprint: str
    namespace_root: bytes  # parent hash of every chain's first block
    block_size: int
    hash_algorithm: str
    num_blocks: int
    kv_cache_dtype: str


def collect_stats(
    num_steps: int,
    scheduler: Scheduler,
    kv_manager: AnyKVCacheManager,
    connector: StoreKVConnector | None,
    encoder_cache: EncoderCache | None,
) -> EngineStats:
    """An EngineStats snapshot from the engine's parts (the engine thread, between steps)."""
    prefix, pool = kv_manager.stats, kv_manager.block_pool
    extra: dict[str, Any] = {}
    if connector is not None:
        s = connector.stats
        extra.update(
            store_hit_tokens=s.hit_tokens,
            store_miss_tokens=s.miss_tokens,
            store_bytes_read=s.bytes_read,
            store_bytes_written=s.bytes_written,
            store_load_s=s.load_s,
            store_save_s=s.save_s,
            store_saves_dropped=s.saves_dropped,
            store_tiers=_tier_stats(connector),
        )
    if encoder_cache is not None:
        extra.update(
            mm_encoder_images=encoder_cache.stats.num_encoded_images,
            mm_encoder_calls=encoder_cache.stats.num_encoder_calls,
            mm_encoder_cache_hits=encoder_cache.stats.num_hits,
            mm_encoder_cache_bytes=encoder_cache.total_bytes,
        )
    return EngineStats(
        num_steps=num_steps,
        num_preemptions=scheduler.num_preemptions,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_num_blocks=kv_manager.num_blocks,
        kv_num_free_blocks=kv_manager.num_free_blocks,
        kv_usage=kv_manager.usage,
        prefix_cache_queries_tokens=prefix.num_queries_tokens,
        prefix_cache_hits_tokens=prefix.num_hit_tokens,
        prefix_cache_partial_hit_tokens=prefix.num_partial_hit_tokens,
        prefix_cache_hit_rate=prefix.hit_rate,
        prefix_cache_evicted_blocks=prefix.num_evicted_blocks,
        prefix_cache_stored_blocks=prefix.num_stored_blocks,
        retained_blocks=pool.num_retained_blocks,
        retained_evicted_blocks=pool.num_retained_evicted,
        uncached_tokens_by_cause=tuple((c, pool.misses.totals[c]) for c in CAUSES),
        **extra,
    )


def _tier_stats(connector: StoreKVConnector) -> tuple[StoreTierStats, ...]:
    store = connector.store
    if isinstance(store, TieredStore):
        return tuple(
            StoreTierStats(t.name, t.served_blocks, t.store.num_misses, t.num_errors)
            for t in store.tier_stats()
        )
    # One store, not wrapped: every hit it counted was served.
    name = getattr(store, "kind", "store")  # the BlockStore protocol's kind
    s = store.stats
    return (StoreTierStats(name, s.num_hits, s.num_misses, getattr(store, "num_errors", 0)),)
