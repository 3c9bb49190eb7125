"""Eviction policies (kvmemo/kv/eviction.py) in the real block pool: each keeps the pool's
invariants through a replay, the default is LRU's order until its ghosts show reuse evicted too
early, and on a workload with a reused prefix between floods of one-off prompts every policy but
LRU keeps the prefix. Torch-free."""

from __future__ import annotations

import pytest

from benchmarks.traces.replay import replay_pool, unlimited
from benchmarks.traces.trace import TraceRequest
from kvmemo.kv.block_pool import BlockPool
from kvmemo.kv.eviction import EVICTION_POLICIES
from kvmemo.kv.hashing import BlockHash
from tests.kv.kv_testing import admit, finish_step, make_manager, make_request
from tests.kv.test_trace_replay import BLOCK, generated_trace

ROOT = BlockHash(b"root")


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(8, "little"))


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
@pytest.mark.parametrize("capacity", [8, 20, 60])
def test_every_policy_keeps_the_pool_invariants_through_a_replay(policy: str, capacity: int) -> None:
    requests = [r for r in generated_trace(400, seed=capacity) if len(r.hash_ids) <= capacity]
    result = replay_pool(requests, capacity, BLOCK, policy=policy, check_every=1)
    assert 0 < result.hit_blocks <= unlimited(requests, BLOCK).hit_blocks


def test_an_unknown_policy_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"eviction policy must be one of \['lru', 'aged-arc'"):
        BlockPool(4, eviction_policy="mru")


def _commit_and_free(pool: BlockPool, reused: set[int]) -> list[int]:
    """Commits one block per id 0..n-1, hits the ones in `reused` once more, frees all in id
    order; returns the ids in the order the pool then evicts them."""
    blocks = pool.get_new_blocks(pool.num_blocks)
    for i, block in enumerate(blocks):
        pool.commit_block(block, key(i), ROOT, (), ())
    pool.touch([blocks[i] for i in sorted(reused)])
    pool.free_blocks(blocks)
    pool.free_blocks([blocks[i] for i in sorted(reused)])  # the hits end last
    victims = pool.get_new_blocks(pool.num_blocks)
    return [block.block_id for block in victims]


def test_aged_arc_evicts_in_lru_order_until_a_ghost_shows_reuse_evicted() -> None:
    reused = {1, 4, 5}
    lru = _commit_and_free(BlockPool(8, eviction_policy="lru"), reused)
    aged = _commit_and_free(BlockPool(8, eviction_policy="aged-arc"), reused)
    assert lru == [0, 2, 3, 6, 7, 1, 4, 5]
    assert aged == lru
    # Plain ARC keeps a size target instead: with no ghost hits yet, it empties T1 first.
    assert _commit_and_free(BlockPool(8, eviction_policy="arc"), reused) == lru


def test_blocks_without_a_hash_go_first_under_the_segmented_policies() -> None:
    for policy in ("aged-arc", "arc", "s3fifo"):
        pool = BlockPool(4, eviction_policy=policy)
        blocks = pool.get_new_blocks(4)
        pool.commit_block(blocks[0], key(0), ROOT, (), ())
        pool.free_blocks(blocks)  # block 0 keeps its hash; 1-3 carry nothing
        assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3], policy
        assert pool.get_cached_block(key(0)) is blocks[0]


def flood_trace(rounds: int, flood_requests: int) -> list[TraceRequest]:
    """Each round: two requests on a shared 2-block prefix (the second reuses it), then a flood
    of one-off 4-block prompts, longer together than the pool."""
    requests: list[TraceRequest] = []
    next_id = 100
    for _ in range(rounds):
        for _ in range(2):
            requests.append(TraceRequest(0.0, 3 * BLOCK, 1, (0, 1, next_id)))
            next_id += 1
        for _ in range(flood_requests):
            ids = tuple(range(next_id, next_id + 4))
            next_id += 4
            requests.append(TraceRequest(0.0, 4 * BLOCK, 1, ids))
    return requests


def test_a_reused_prefix_outlives_one_off_floods_where_lru_loses_it() -> None:
    requests = flood_trace(rounds=200, flood_requests=5)  # 20 one-off blocks a round, pool of 16
    hits = {p: replay_pool(requests, 16, BLOCK, policy=p, check_every=50).hit_blocks
            for p in EVICTION_POLICIES}
    assert hits["lru"] == 2 * 200  # only the second request of a round hits the prefix
    for policy in EVICTION_POLICIES:
        if policy != "lru":
            assert hits[policy] >= 1.5 * hits["lru"], (policy, hits)



@pytest.mark.parametrize("policy", EVICTION_POLICIES)
@pytest.mark.parametrize("batch_priority", [1, 0])
def test_a_low_priority_request_leaves_its_own_blocks_first(policy: str, batch_priority: int
                                                            ) -> None:
    """A request of priority > 0 (vLLM's: less important) ends after a normal one: the cached
    block only it used is the first evicted, before the normal request's older one; at
    priority 0 (the control) the older block goes first. The shared prefix stays."""
    manager = make_manager(12, 4, policy)
    shared = list(range(100, 108))  # two full blocks
    normal = make_request("normal", shared + [1, 2, 3, 4, 5])  # + one own full block
    batch = make_request("batch", shared + [7, 8, 9, 10, 11])
    batch.priority = batch_priority
    for request in (normal, batch):
        admit(manager, request)
        finish_step(manager, request)
    pool = manager.block_pool
    normal_own = pool.blocks[manager.get_block_table("normal")[2]].block_hash
    batch_own = pool.blocks[manager.get_block_table("batch")[2]].block_hash
    manager.free(normal)
    manager.free(batch)
    evicted_before = pool.num_evicted_blocks
    while pool.num_evicted_blocks == evicted_before:
        pool.get_new_blocks(1)
    assert (pool.get_cached_block(batch_own) is None) == (batch_priority > 0)
    assert (pool.get_cached_block(normal_own) is None) == (batch_priority == 0)
    assert all(pool.get_cached_block(h) is not None for h in normal.block_hashes[:2])
