"""The trace replay (benchmarks/traces/replay.py) against an independent LRU written here, on a
generated prefix-chained trace: the same hits request by request, the pool's invariants hold after
every request, and the unlimited and Belady references bound it. Torch-free."""

from __future__ import annotations

import json
import random
from collections import deque

import pytest

from benchmarks.traces.replay import belady, main, replay_pool, unlimited
from benchmarks.traces.store_tier import StoreTier
from benchmarks.traces.trace import TraceRequest, read_mooncake, read_trace

BLOCK = 4  # tokens per block in the generated trace


def generated_trace(num_requests: int, seed: int) -> list[TraceRequest]:
    """Requests whose ids are prefix-chained: each extends a random earlier request's prefix (a
    shared system prompt, a conversation's next turn) or starts a chain of its own."""
    rng = random.Random(seed)
    chains: list[tuple[int, ...]] = []
    next_id = 0
    requests = []
    for i in range(num_requests):
        if chains and rng.random() < 0.7:
            base = rng.choice(chains)
            prefix = base[: rng.randint(1, len(base))]
        else:
            prefix = ()
        new = rng.randint(1, 6)
        ids = prefix + tuple(range(next_id, next_id + new))
        next_id += new
        chains.append(ids)
        length = len(ids) * BLOCK - rng.randint(0, BLOCK - 1)  # the last block may be partial
        requests.append(TraceRequest(float(i), length, 1, ids))
    return requests


def reference_lru(requests: list[TraceRequest], capacity: int) -> list[int]:
    """Hits per request of the pool's LRU, modelled as a queue of slots (an id, or None for a
    slot holding nothing reusable), evicted from the left: hit slots leave the queue while the
    request runs, each miss takes the leftmost slot, and at the end the request's slots return
    deepest first. A miss whose id is cached further along (after a gap in its chain) keeps
    that copy; its own slot returns holding nothing (stored once)."""
    queue: deque[int | None] = deque([None] * capacity)
    hits_per_request = []
    for request in requests:
        ids = request.hash_ids
        present = set(x for x in queue if x is not None)
        hits = 0
        while hits < len(ids) and ids[hits] in present:
            hits += 1
        for hash_id in ids[:hits]:
            queue.remove(hash_id)
        duplicates = {x for x in ids[hits:] if x in present}
        for _ in range(len(ids) - hits):
            queue.popleft()
        returned = [x if (i < hits or x not in duplicates) else None for i, x in enumerate(ids)]
        queue.extend(reversed(returned))
        hits_per_request.append(hits)
    return hits_per_request


@pytest.mark.parametrize("capacity", [8, 20, 60])
def test_lru_replay_equals_the_reference_request_by_request(capacity: int) -> None:
    requests = [r for r in generated_trace(400, seed=capacity) if len(r.hash_ids) <= capacity]
    result = replay_pool(requests, capacity, BLOCK, check_every=1)
    assert result.per_request_hit_blocks == reference_lru(requests, capacity)
    assert 0 < result.hit_ratio <= belady(requests, capacity, BLOCK).hit_ratio + 1e-9
    assert belady(requests, capacity, BLOCK).hit_ratio <= unlimited(requests, BLOCK).hit_ratio


def test_requests_in_flight_hold_their_blocks() -> None:
    """A request that ends before the next arrives is the immediate-free replay exactly; one that
    decodes across many arrivals holds its blocks (a later request waits for room), and the
    pool stays consistent throughout."""
    requests = generated_trace(300, seed=7)  # 1 ms apart, 1 output token each
    done = replay_pool(requests, 60, BLOCK)
    quick = replay_pool(requests, 60, BLOCK, decode_ms_per_token=0.5, check_every=1)
    assert quick.per_request_hit_blocks == done.per_request_hit_blocks
    # ~40 requests decoding at once need more than 60 blocks: arrivals wait for room
    slow = replay_pool(requests, 60, BLOCK, decode_ms_per_token=40.0, check_every=1)
    assert slow.num_requests == len(requests) and slow.hit_tokens > 0


def test_the_cli_reads_a_mooncake_file(tmp_path, capsys) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": i, "input_length": len(r.hash_ids) * 512, "output_length": 3,
             "hash_ids": list(r.hash_ids)} for i, r in enumerate(generated_trace(50, seed=1))]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    assert len(read_mooncake(path)) == 50
    assert main([str(path), "--capacity-tokens", str(40 * 512), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 50 and report["capacity_blocks"] == 40
    assert report["hit_ratio"] <= report["belady_hit_ratio"] <= report["unlimited_hit_ratio"]
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1: not a Mooncake trace line"):
        read_mooncake(path)


def test_the_cli_reads_an_alibaba_file_in_its_own_block_size(tmp_path, capsys) -> None:
    requests = generated_trace(60, seed=2)
    rows = []
    for i, r in enumerate(requests):
        parent = next((j for j in range(i - 1, -1, -1)
                       if requests[j].hash_ids[0] == r.hash_ids[0]), -1)
        rows.append({"chat_id": i, "parent_chat_id": parent, "timestamp": i * 0.5,
                     "input_length": r.input_length * 4, "output_length": 2, "type": "text",
                     "turn": 1 if parent < 0 else 2, "hash_ids": list(r.hash_ids)})
    path = tmp_path / "bailian.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    fmt, read = read_trace(path)
    assert fmt == "alibaba" and read[3].timestamp_ms == 1500.0 and read[3].kind == "text"
    assert [r.hash_ids for r in read] == [r.hash_ids for r in requests]
    assert main([str(path), "--capacity-tokens", str(20 * 16), "--policy", "lru", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "alibaba" and report["block_tokens"] == 16
    assert report["capacity_blocks"] == 20
    fitting = [r for r in read if len(r.hash_ids) <= 20]
    hits = replay_pool(fitting, 20, 16).per_request_hit_blocks
    assert hits == reference_lru(fitting, 20)
    path.write_text('{"chat_id": 0, "parent_chat_id": -1, "timestamp": 0}\n')
    with pytest.raises(ValueError, match="bailian.jsonl:1: not an Alibaba trace line"):
        read_trace(path)


def test_a_store_tier_serves_what_the_pool_evicted_and_admission_writes_less() -> None:
    # A 2-block prefix, a flood past the 8-block pool, the prefix again; then one-offs only.
    prefix = TraceRequest(0.0, 3 * BLOCK, 1, (0, 1, 2))
    flood = [TraceRequest(0.0, 4 * BLOCK, 1, tuple(range(10 + 4 * i, 14 + 4 * i)))
             for i in range(4)]
    again = TraceRequest(0.0, 3 * BLOCK, 1, (0, 1, 3))
    requests = [prefix, *flood, again]
    plain = replay_pool(requests, 8, BLOCK, policy="lru")
    assert plain.per_request_hit_blocks[-1] == 0 and plain.store_hit_tokens == 0
    store = StoreTier(100, "all")
    tiered = replay_pool(requests, 8, BLOCK, policy="lru", store=store)
    assert tiered.store_hit_tokens == 2 * BLOCK  # blocks 0 and 1 came back from the store
    assert store.counters.written_blocks == 3 + 16 + 1
    reused = StoreTier(100, "reused")
    replay_pool(requests, 8, BLOCK, policy="lru", store=reused)
    assert reused.counters.written_blocks == 2  # only the recomputed prefix
    assert reused.counters.read_blocks == 0
    # A full store drops its least recently used blocks, a chain's tail before its head.
    small = StoreTier(3, "all")
    small.computed([0, 1, 2])
    small.computed([5])
    assert small.read_run([0, 1]) == 2 and small.read_run([2]) == 0
