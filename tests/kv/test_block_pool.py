"""BlockPool and its free queue: LRU order, touch, eviction, stored-once commits, collisions."""

from __future__ import annotations

import hashlib

import pytest

from kvmemo.kv import hashing
from kvmemo.kv.block_pool import Block, BlockPool
from kvmemo.kv.events import BlockStored
from kvmemo.kv.free_queue import FreeBlockQueue
from kvmemo.kv.hashing import BlockHash
from tests.kv.kv_testing import admit, finish_step, make_layout, make_manager, make_request

_H1, _H2, _ROOT = BlockHash(b"h1"), BlockHash(b"h2"), BlockHash(b"root")


def test_free_queue_is_an_o1_lru() -> None:
    nodes = [Block(i) for i in range(5)]
    queue: FreeBlockQueue[Block] = FreeBlockQueue(nodes)
    queue.remove(nodes[2])
    queue.append(nodes[2])
    assert [n.block_id for n in queue] == [0, 1, 3, 4, 2] and len(queue) == 5
    assert queue.popleft() is nodes[0] and not nodes[0].is_free
    queue.remove(nodes[4])
    queue.remove(nodes[1])
    queue.check_links()
    assert [n.block_id for n in queue] == [3, 2]
    queue.appendleft(nodes[0])
    assert [n.block_id for n in queue] == [0, 3, 2]
    queue.check_links()
    queue.popleft(), queue.popleft(), queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    queue.check_links()


def test_pool_touch_free_and_evict() -> None:
    pool = BlockPool(4, enable_events=True)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id, a.ref_count) == (0, 1, 1)
    assert pool.commit_block(a, _H1, _ROOT, (1, 2), ())
    assert pool.take_events() == [BlockStored((_H1,), _ROOT, (1, 2), 2, ())]
    pool.free_blocks([b, a])
    assert pool.free_block_ids() == [2, 3, 1, 0] and pool.usage == 0.0
    assert pool.get_cached_block(_H1) is a
    pool.touch([a])  # hit on a free block: leaves the queue
    assert pool.free_block_ids() == [2, 3, 1] and a.ref_count == 1 and pool.usage == 0.25
    pool.free_blocks([a])
    assert [blk.block_id for blk in pool.get_new_blocks(4)] == [2, 3, 1, 0]
    assert pool.get_cached_block(_H1) is None and a.block_hash is None
    assert pool.num_evicted_blocks == 1
    with pytest.raises(ValueError, match="num_free_blocks"):
        pool.get_new_blocks(1)
    pool.check_invariants()


def test_commit_is_once_and_stored_once() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.commit_block(a, _H1, _ROOT, (1,), ())
    assert not pool.commit_block(b, _H1, _ROOT, (1,), ())  # duplicate stays private
    assert b.block_hash is None and pool.get_cached_block(_H1) is a
    with pytest.raises(AssertionError):
        pool.commit_block(a, _H2, _ROOT, (1,), ())  # a block's hash is assigned once
    pool.check_invariants()


def test_bad_sizes_are_value_errors() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="block_size"):  # one layout: no second size to disagree
        make_layout(block_size=0)
    request = make_request("a", [1, 2, 3])
    request.num_computed_tokens = 1
    with pytest.raises(ValueError, match="num_computed_tokens"):
        make_manager().get_computed_blocks(request)
    with pytest.raises(ValueError, match="num_new_tokens"):
        make_manager().allocate_slots(make_request("b", [1]), -1)


def test_hash_collision_never_serves_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    def colliding(parent: BlockHash, *_: object) -> BlockHash:
        return BlockHash(hashlib.sha256(parent).digest())  # ignores the tokens: all chains collide

    monkeypatch.setattr(hashing, "hash_block", colliding)
    manager = make_manager()
    a = make_request("a", list(range(9)))
    admit(manager, a)
    finish_step(manager, a)
    b = make_request("b", list(range(100, 109)))
    assert b.block_hashes == a.block_hashes[:2]  # hashed at construction: the chains collide
    assert manager.get_computed_blocks(b).num_tokens == 0
    assert b.block_hashes == a.block_hashes  # the hashes did collide
    # The same tokens still hit.
    assert manager.get_computed_blocks(make_request("c", list(range(9)))).num_tokens == 8
