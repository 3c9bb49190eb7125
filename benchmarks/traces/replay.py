"""Replay a production trace through kvmemo's own block pool (kv/block_pool.py, torch-free) and
report the token-weighted prefix hit ratio beside an unlimited cache and Belady's optimum.

    python -m benchmarks.traces.replay ../shared/traces/mooncake/conversation_trace.jsonl \
        --capacity-tokens 3000000 [--policy aged-arc] [--format auto] [--block-tokens 512] \
        [--decode-ms-per-token 0] [--limit N] [--json]

Formats (trace.py): Mooncake's (512-token blocks) and Alibaba Bailian's (16-token blocks, with
chat_id, parent_chat_id, turn and type); `--format auto` tells them by the first line, and
`--block-tokens` defaults to the format's block size. Policies: kvmemo/kv/eviction.py.

Invariant: the pool is driven as the KV manager drives it: a request's cached prefix is found
block by block from its first block (a hit needs every block before it), its hit blocks are
touched, the rest are new blocks (the pool evicts from its free queue's head) committed under the
trace's ids chained to their predecessors, and when the request ends its blocks are freed
last-first, so its tail is evicted before its shareable head. A request ends at its timestamp plus
output_length x --decode-ms-per-token (0: before the next request arrives); until then its blocks
cannot be evicted, and a request that finds no room waits for the earliest to end.
Hit ratio = prompt tokens in hit blocks / prompt tokens (block i of a request covers its tokens
[i * B, min((i + 1) * B, input_length))).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.traces.store_tier import ADMISSIONS, StoreTier
from benchmarks.traces.trace import BLOCK_TOKENS, TRACE_FORMATS, TraceRequest, read_trace
from kvmemo.kv.block import Block
from kvmemo.kv.block_pool import BlockPool
from kvmemo.kv.eviction import DEFAULT_EVICTION_POLICY
from kvmemo.kv.eviction import EVICTION_POLICIES as POLICIES
from kvmemo.kv.hashing import BlockHash
from kvmemo.kv.keyed_eviction import KEYED_POLICIES

ROOT = BlockHash(b"trace-root")


@dataclass
class ReplayResult:
    policy: str
    capacity_blocks: int
    block_tokens: int
    num_requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    evicted_blocks: int = 0
    store_hit_tokens: int = 0  # read from the store tier after the device hit
    per_request_hit_blocks: list[int] = field(default_factory=list, repr=False)

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    def record(self, request: TraceRequest, hits: int, store_hits: int = 0) -> None:
        self.num_requests += 1
        self.prompt_tokens += request.input_length
        self.prompt_blocks += len(request.hash_ids)
        self.hit_blocks += hits
        self.hit_tokens += sum(request.block_tokens(i, self.block_tokens) for i in range(hits))
        self.store_hit_tokens += sum(request.block_tokens(i, self.block_tokens)
                                     for i in range(hits, hits + store_hits))
        self.per_request_hit_blocks.append(hits)


def block_hash(hash_id: int) -> BlockHash:
    return BlockHash(hash_id.to_bytes(8, "little", signed=True))


def replay_pool(requests: Sequence[TraceRequest], capacity_blocks: int, block_tokens: int = 512,
                decode_ms_per_token: float = 0.0, policy: str = "lru",
                check_every: int = 0, store: StoreTier | None = None) -> ReplayResult:
    """The trace through a BlockPool of capacity_blocks blocks (and a store tier behind it, if
    given); check_every > 0 runs the pool's invariant checker after every that many requests
    (tests)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    pool = BlockPool(capacity_blocks, enable_caching=True, eviction_policy=policy)
    result = ReplayResult(policy, capacity_blocks, block_tokens)
    in_flight: list[tuple[float, int, list[Block]]] = []  # (end ms, order, blocks) heap
    for order, request in enumerate(requests):
        if len(request.hash_ids) > capacity_blocks:
            raise ValueError(f"request {order} needs {len(request.hash_ids)} blocks; the pool "
                             f"holds {capacity_blocks}: raise --capacity-tokens")
        now = request.timestamp_ms
        while in_flight and in_flight[0][0] <= now:
            pool.free_blocks(reversed(heapq.heappop(in_flight)[2]))
        hits: list[Block] = []
        for hash_id in request.hash_ids:
            block = pool.get_cached_block(block_hash(hash_id))
            if block is None:
                break
            hits.append(block)
        pool.touch(hits)  # before any eviction: a hit block is not evictable now
        misses = len(request.hash_ids) - len(hits)
        while pool.num_free_blocks < misses:  # wait for the earliest request to end
            pool.free_blocks(reversed(heapq.heappop(in_flight)[2]))
        new = pool.get_new_blocks(misses)
        parent = ROOT if not hits else hits[-1].block_hash
        for block, hash_id in zip(new, request.hash_ids[len(hits):]):
            own = block_hash(hash_id)
            pool.commit_block(block, own, parent, (), ())
            parent = own
        store_hits = 0
        if store is not None:
            ids = request.hash_ids
            store.device_hits(ids[:len(hits)])
            store_hits = store.read_run(ids[len(hits):])
            store.computed(ids[len(hits) + store_hits:])
        result.record(request, len(hits), store_hits)
        blocks = hits + new
        end = now + request.output_length * decode_ms_per_token
        if decode_ms_per_token > 0:
            heapq.heappush(in_flight, (end, order, blocks))
        else:
            pool.free_blocks(reversed(blocks))
        if check_every and order % check_every == 0:
            pool.check_invariants()
    result.evicted_blocks = pool.num_evicted_blocks
    return result


def unlimited(requests: Sequence[TraceRequest], block_tokens: int = 512) -> ReplayResult:
    """Every block ever computed stays: the trace's reuse ceiling."""
    result = ReplayResult("unlimited", 0, block_tokens)
    seen: set[int] = set()
    for request in requests:
        hits = 0
        while hits < len(request.hash_ids) and request.hash_ids[hits] in seen:
            hits += 1
        seen.update(request.hash_ids)
        result.record(request, hits)
    return result


def belady(requests: Sequence[TraceRequest], capacity_blocks: int,
           block_tokens: int = 512) -> ReplayResult:
    """Belady's policy at the same capacity: when room is needed, evict the cached block whose
    next use lies farthest ahead (never one of the arriving request's hits, whose next use is
    now). Requests end before the next arrives. The reference a policy is measured against."""
    uses: dict[int, list[int]] = defaultdict(list)
    for index, request in enumerate(requests):
        for hash_id in request.hash_ids:
            uses[hash_id].append(index)
    cursor: dict[int, int] = defaultdict(int)  # per id, its next entry in uses

    def next_use(hash_id: int, after: int) -> float:
        positions, i = uses[hash_id], cursor[hash_id]
        while i < len(positions) and positions[i] <= after:
            i += 1
        cursor[hash_id] = i
        return positions[i] if i < len(positions) else float("inf")

    result = ReplayResult("belady", capacity_blocks, block_tokens)
    cached: dict[int, float] = {}  # id -> its next use
    heap: list[tuple[float, int]] = []  # (-next use, id), stale entries skipped
    for index, request in enumerate(requests):
        ids = request.hash_ids
        hits = 0
        while hits < len(ids) and ids[hits] in cached:
            hits += 1
        protected = set(ids[:hits])
        missing = [hash_id for hash_id in ids[hits:] if hash_id not in cached]
        deferred = []
        while len(cached) + len(missing) > capacity_blocks:
            negative, hash_id = heapq.heappop(heap)
            if cached.get(hash_id) != -negative:
                continue  # stale
            if hash_id in protected:
                deferred.append((negative, hash_id))
                continue
            del cached[hash_id]
        for entry in deferred:
            heapq.heappush(heap, entry)
        for hash_id in ids:
            when = next_use(hash_id, index)
            cached[hash_id] = when
            heapq.heappush(heap, (-when, hash_id))
        result.record(request, hits)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Mooncake or Alibaba Bailian trace (JSON lines)")
    parser.add_argument("--capacity-tokens", type=int, required=True)
    parser.add_argument("--policy", default=DEFAULT_EVICTION_POLICY, choices=POLICIES,
                        help=f"the pool's eviction policy (default: {DEFAULT_EVICTION_POLICY})")
    parser.add_argument("--format", default="auto", choices=("auto", *TRACE_FORMATS))
    parser.add_argument("--block-tokens", type=int, default=None,
                        help="tokens per hash id (default: the format's, Mooncake 512, "
                        "Alibaba 16)")
    parser.add_argument("--decode-ms-per-token", type=float, default=0.0,
                        help="model requests in flight: each holds its blocks for output_length "
                        "x this many ms after its timestamp (default 0: freed at once)")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--store-capacity-tokens", type=int, default=0,
                        help="a persistent store tier behind the pool (store_tier.py); 0: none")
    parser.add_argument("--store-admission", default="all", choices=ADMISSIONS,
                        help="what the store writes: every computed block (kvmemo's connector "
                        "today), or only blocks seen twice")
    parser.add_argument("--store-eviction", default="lru", choices=KEYED_POLICIES,
                        help="the store's eviction, as kv_store's ?eviction= (default: lru, "
                        "the disk tier's default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    fmt, requests = read_trace(args.trace, args.format, args.limit)
    if args.block_tokens is None:
        args.block_tokens = BLOCK_TOKENS[fmt]
    if args.capacity_tokens < args.block_tokens or args.block_tokens < 1:
        parser.error("--capacity-tokens must hold at least one block of --block-tokens (>= 1)")
    capacity = args.capacity_tokens // args.block_tokens
    start = time.perf_counter()
    store = (StoreTier(args.store_capacity_tokens // args.block_tokens, args.store_admission,
                       eviction=args.store_eviction)
             if args.store_capacity_tokens else None)
    pool = replay_pool(requests, capacity, args.block_tokens, args.decode_ms_per_token,
                       args.policy, store=store)
    seconds = time.perf_counter() - start
    best = belady(requests, capacity, args.block_tokens)
    ceiling = unlimited(requests, args.block_tokens)
    report = {
        "trace": args.trace, "format": fmt, "requests": len(requests), "policy": args.policy,
        "capacity_tokens": capacity * args.block_tokens, "capacity_blocks": capacity,
        "block_tokens": args.block_tokens, "decode_ms_per_token": args.decode_ms_per_token,
        "hit_ratio": round(pool.hit_ratio, 4), "block_hit_ratio": round(pool.block_hit_ratio, 4),
        "belady_hit_ratio": round(best.hit_ratio, 4),
        "unlimited_hit_ratio": round(ceiling.hit_ratio, 4),
        "evicted_blocks": pool.evicted_blocks, "replay_s": round(seconds, 3),
    }
    if store is not None:
        written = store.counters.written_blocks * args.block_tokens
        report.update({
            "store_capacity_tokens": args.store_capacity_tokens,
            "store_admission": args.store_admission, "store_eviction": args.store_eviction,
            "store_hit_ratio": round(pool.store_hit_tokens / max(pool.prompt_tokens, 1), 4),
            "total_hit_ratio": round((pool.hit_tokens + pool.store_hit_tokens)
                                     / max(pool.prompt_tokens, 1), 4),
            "store_written_tokens": written,
            "store_written_per_hit_token": round(written / max(pool.store_hit_tokens, 1), 2),
        })
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


