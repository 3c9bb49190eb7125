"""Prometheus metrics of one server, on its own CollectorRegistry (never the global one).

Invariant: counters only move when requests run; gauges read the engine thread's latest
snapshot at scrape time, so a scrape never touches the Engine itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from kvmemo.engine import AsyncEngine

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """Owns the registry and every metric the server exports."""

    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvmemo_requests",
            "HTTP requests by route and status code",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvmemo_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "kvmemo_e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvmemo_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "kvmemo_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generation_tokens = Counter("kvmemo_generation_tokens", "Generated tokens", registry=r)
        # vLLM's speculative decoding counters (vllm:spec_decode_num_*), in kvmemo's prefix.
        self.spec_drafts = Counter(
            "kvmemo_spec_decode_num_drafts", "Steps that verified a draft", registry=r
        )
        self.spec_draft_tokens = Counter(
            "kvmemo_spec_decode_num_draft_tokens", "Drafted tokens verified", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "kvmemo_spec_decode_num_accepted_tokens", "Drafted tokens accepted", registry=r
        )

        def gauge(name: str, doc: str, read) -> None:
            Gauge(name, doc, registry=r).set_function(read)

        gauge(
            "kvmemo_num_requests_running",
            "Sequences running in the engine",
            lambda: float(engine.stats.num_running),
        )
        gauge(
            "kvmemo_num_requests_waiting",
            "Sequences waiting for admission",
            lambda: float(engine.stats.num_waiting),
        )
        gauge(
            "kvmemo_kv_blocks_in_use",
            "KV blocks referenced by requests (cached free blocks excluded)",
            lambda: float(engine.stats.kv_num_blocks - engine.stats.kv_num_free_blocks),
        )
        gauge(
            "kvmemo_kv_blocks_total",
            "KV blocks in the pool",
            lambda: float(engine.stats.kv_num_blocks),
        )
        gauge(
            "kvmemo_kv_cache_usage",
            "Fraction of KV blocks in use",
            lambda: float(engine.stats.kv_usage),
        )
        gauge(
            "kvmemo_prefix_cache_hit_rate",
            "Prefix-cache hit tokens / queried tokens",
            lambda: float(engine.stats.prefix_cache_hit_rate),
        )
        gauge(
            "kvmemo_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache (cumulative)",
            lambda: float(engine.stats.prefix_cache_hits_tokens),
        )
        gauge(
            "kvmemo_retained_blocks",
            "KV blocks retained now by cache_control / prompt_cache_retention (every tenant)",
            lambda: float(engine.stats.retained_blocks),
        )
        gauge(
            "kvmemo_retained_evicted_blocks",
            "Retained KV blocks evicted before their time because no other block was free "
            "(cumulative)",
            lambda: float(engine.stats.retained_evicted_blocks),
        )
        gauge(
            "kvmemo_store_hit_tokens",
            "Prompt tokens loaded from the persistent KV store (0 without --kv-store)",
            lambda: float(engine.stats.store_hit_tokens),
        )

        tier_hits = Gauge(
            "kvmemo_store_tier_served_blocks",
            "Blocks each KV store tier served "
            "(cumulative; the first tier holding a block serves it)",
            ["tier"],
            registry=r,
        )
        tier_errors = Gauge(
            "kvmemo_store_tier_errors",
            "Failed calls to each KV store tier (connection lost, timeout), cumulative",
            ["tier"],
            registry=r,
        )
        uncached = Gauge(
            "kvmemo_prompt_uncached_tokens",
            "Prompt tokens computed rather than read from the cache, by cause (cumulative; "
            "docs/server.md explains each)",
            ["cause"],
            registry=r,
        )
        for index, (cause, _) in enumerate(engine.stats.uncached_tokens_by_cause):
            def count(i: int = index) -> float:
                return float(engine.stats.uncached_tokens_by_cause[i][1])

            uncached.labels(cause).set_function(count)
        for index, tier in enumerate(engine.stats.store_tiers):  # fixed when the engine is built
            def served(i: int = index) -> float:
                return float(engine.stats.store_tiers[i].served_blocks)

            def errors(i: int = index) -> float:
                return float(engine.stats.store_tiers[i].errors)

            tier_hits.labels(tier.name).set_function(served)
            tier_errors.labels(tier.name).set_function(errors)

    def render(self) -> bytes:
        return generate_latest(self.registry)
