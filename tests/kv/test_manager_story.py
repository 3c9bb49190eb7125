"""Story tests: exact block ids, ref counts and free-queue order after every step (block_size 4)."""

from __future__ import annotations

from kvmemo.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmemo.kv.mm_items import MultiModalItem
from tests.kv.kv_testing import (
    admit,
    finish_step,
    hit_ids,
    make_manager,
    make_request,
    ref_counts,
)


def test_prefix_caching_story() -> None:
    manager = make_manager(num_blocks=10, enable_events=True)
    pool = manager.block_pool
    a = make_request("a", list(range(10)))  # | 0 1 2 3 | 4 5 6 7 | 8 9 . . |

    prefix, new_ids = admit(manager, a)
    assert prefix.num_tokens == 0 and new_ids == [0, 1, 2]
    assert ref_counts(manager) == {0: 1, 1: 1, 2: 1}
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9]

    # Not computed yet: nothing to hit, nothing advertised.
    assert manager.get_computed_blocks(make_request("early", list(range(10)))).num_tokens == 0
    finish_step(manager, a, 10)
    stored = manager.take_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    assert stored[0].token_ids == (0, 1, 2, 3) and stored[1].parent_block_hash == a.block_hashes[0]

    # B shares two full blocks with A.
    b = make_request("b", list(range(8)) + [20, 21, 22])
    prefix, new_ids = admit(manager, b)
    assert hit_ids(prefix) == [0, 1] and prefix.num_tokens == 8 and prefix.partial is None
    assert new_ids == [3]
    assert manager.get_block_table("b") == [0, 1, 3]
    assert ref_counts(manager) == {0: 2, 1: 2, 2: 1, 3: 1}
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9]

    # Free A: only its private tail reaches 0.
    manager.free(a)
    manager.check_invariants()
    assert ref_counts(manager) == {0: 1, 1: 1, 3: 1}
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]

    # Free B: tail first, so the shared head is evicted last.
    finish_step(manager, b, 3)
    manager.free(b)
    manager.check_invariants()
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert manager.get_block_table("b") == []

    # C hits two FREE blocks: they leave the queue, and admission counts them.
    c = make_request("c", list(range(8)) + [30])
    prefix, new_ids = admit(manager, c)
    assert hit_ids(prefix) == [0, 1] and new_ids == [4]
    assert pool.free_block_ids() == [5, 6, 7, 8, 9, 2, 3]
    assert ref_counts(manager) == {0: 1, 1: 1, 4: 1}
    finish_step(manager, c, 1)
    manager.free(c)
    assert pool.free_block_ids() == [5, 6, 7, 8, 9, 2, 3, 4, 1, 0]

    # D takes 8 blocks from the LRU head; the hashed blocks 1 and 0 are the last free ones.
    d = make_request("d", [100 + i for i in range(32)])
    _, new_ids = admit(manager, d)
    assert new_ids == [5, 6, 7, 8, 9, 2, 3, 4] and pool.free_block_ids() == [1, 0]
    manager.take_events()
    # E pops block 1: its hash is evicted, and A's chain now hits block 0 only.
    e = make_request("e", [200, 201, 202])
    _, new_ids = admit(manager, e)
    assert new_ids == [1] and pool.free_block_ids() == [0]
    assert manager.take_events() == [BlockRemoved(block_hashes=(a.block_hashes[1],))]
    assert hit_ids(manager.get_computed_blocks(make_request("a2", list(range(10))))) == [0]
    manager.free(e)
    manager.free(d)
    manager.check_invariants()
    assert manager.num_free_blocks == 10
    assert manager.stats.num_evicted_blocks == 1 and manager.stats.num_stored_blocks == 2


def test_admission_failure_changes_nothing() -> None:
    manager = make_manager(num_blocks=6)
    a = make_request("a", list(range(12)))
    admit(manager, a)
    finish_step(manager, a, 12)
    manager.free(a)  # free queue: 3 4 5 2 1 0, blocks 0-2 hashed
    hold = make_request("hold", [50, 51, 52, 53, 54])
    admit(manager, hold)  # takes 3, 4
    pool = manager.block_pool
    before = (pool.free_block_ids(), ref_counts(manager), [b.block_hash for b in pool.blocks])

    # 2 free hits (0, 1) + 3 new blocks = 5 > 4 free blocks.
    big = make_request("big", list(range(8)) + [60] * 10)
    prefix = manager.get_computed_blocks(big)
    assert hit_ids(prefix) == [0, 1]
    assert manager.allocate_slots(big, big.num_tokens - prefix.num_tokens, prefix) is None
    after = (pool.free_block_ids(), ref_counts(manager), [b.block_hash for b in pool.blocks])
    assert after == before
    assert manager.get_block_table("big") == [] and manager.take_copies() == []
    manager.check_invariants()

    # With 2 new blocks it fits exactly: 2 free hits + 2 new = 4.
    fits = make_request("fits", list(range(8)) + [60] * 5)
    prefix, new_ids = admit(manager, fits)
    assert hit_ids(prefix) == [0, 1] and new_ids == [5, 2]
    assert manager.num_free_blocks == 0 and manager.usage == 1.0


def test_never_hit_the_last_token() -> None:
    manager = make_manager()
    a = make_request("a", list(range(12)))  # exactly 3 full blocks
    admit(manager, a)
    finish_step(manager, a, 12)
    prefix = manager.get_computed_blocks(make_request("b", list(range(12))))
    assert hit_ids(prefix) == [0, 1] and prefix.num_tokens == 11  # block 2 copied but its last
    assert prefix.partial is not None and prefix.partial.block.block_id == 2
    # With partial reuse, the same block is still found up to the last token but one.
    prefix = manager.get_computed_blocks(make_request("c", list(range(13))))
    assert hit_ids(prefix) == [0, 1, 2] and prefix.num_tokens == 12


def test_chunked_prefill_commits_only_computed_blocks() -> None:
    manager = make_manager(num_blocks=12, block_size=16)
    prompt = list(range(48)) + [999]  # 3 full blocks and 1 token
    a = make_request("a", prompt)
    expected_hits = {20: 1, 40: 2, 49: 3}
    for chunk_end in (20, 40, 49):
        if chunk_end == 20:
            admit(manager, a, 20)
        else:
            manager.allocate_slots(a, chunk_end - a.num_computed_tokens)
        # Scheduled but not computed: a newcomer must not see the blocks of this chunk.
        early = manager.get_computed_blocks(make_request("x", prompt + [1]))
        assert early.num_tokens == a.num_computed_tokens  # what earlier steps computed, no more
        finish_step(manager, a, chunk_end - a.num_computed_tokens)
        b = make_request("b", prompt + [1])
        prefix = manager.get_computed_blocks(b)
        assert len(prefix.blocks) == expected_hits[chunk_end]
        assert prefix.num_tokens == chunk_end  # full blocks plus the computed part of the next
    # A second request arriving mid-prefill and admitted now hits only committed blocks.
    b = make_request("b", prompt + [1])
    prefix, _ = admit(manager, b)
    assert hit_ids(prefix) == manager.get_block_table("a")[:3]


def test_generated_tokens_become_hits_while_the_owner_runs() -> None:
    manager = make_manager()
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(manager, a)
    finish_step(manager, a, 6)
    for token in (7, 8, 9):  # decode: each step computes the token sampled before it
        a.append_output_token(token)
        manager.allocate_slots(a, 1)
        finish_step(manager, a, 1)
    assert a.num_computed_tokens == 9  # block [5 6 7 8] is full and computed
    b = make_request("b", a.all_token_ids[:])
    prefix, _ = admit(manager, b)
    assert hit_ids(prefix) == manager.get_block_table("a")[:2]
    assert manager.block_pool.blocks[manager.get_block_table("a")[1]].ref_count == 2


def test_duplicate_blocks_are_stored_once() -> None:
    manager = make_manager(enable_events=True)
    a, b = make_request("a", list(range(6))), make_request("b", list(range(6)))
    admit(manager, a)
    admit(manager, b)  # same prompt in the same step: no hit yet
    finish_step(manager, a, 6)
    finish_step(manager, b, 6)
    pool = manager.block_pool
    assert pool.blocks[0].block_hash == a.block_hashes[0]
    assert pool.blocks[2].block_hash is None  # b's copy stays private
    assert len(manager.take_events()) == 1
    manager.free(a)
    manager.free(b)
    prefix = manager.get_computed_blocks(make_request("c", list(range(6))))
    assert prefix.blocks[0] is pool.blocks[0]


def test_cache_salts_and_images_isolate() -> None:
    manager = make_manager(num_blocks=40)
    tokens = list(range(12))
    for rid, kwargs in [("s1", {"cache_salt": "t1"}), ("l1", {"cache_salt": "x"}), ("p", {})]:
        req = make_request(rid, tokens, **kwargs)
        admit(manager, req)
        finish_step(manager, req, 12)
    probe = tokens + [0]

    def hits(**kwargs: object) -> int:
        return len(manager.get_computed_blocks(make_request("q", probe, **kwargs)).blocks)

    assert hits(cache_salt="t1") == 3 and hits(cache_salt="t2") == 0
    assert hits(cache_salt="x") == 3 and hits(cache_salt="y") == 0
    assert hits() == 3

    img = make_request("i", tokens, mm_items=[MultiModalItem(5, 4, b"cat")])
    admit(manager, img)
    finish_step(manager, img)
    assert hits(mm_items=[MultiModalItem(5, 4, b"cat")]) == 3
    assert hits(mm_items=[MultiModalItem(5, 4, b"dog")]) == 1  # block 0 precedes the image
    assert hits(mm_items=[MultiModalItem(4, 4, b"cat")]) == 1  # same image, other position


def test_reset_prefix_cache() -> None:
    manager = make_manager(enable_events=True)
    a = make_request("a", list(range(10)))
    admit(manager, a)
    finish_step(manager, a, 10)
    assert manager.reset_prefix_cache() == (False, "3 blocks are still held by running requests")
    manager.free(a)
    manager.take_events()
    assert manager.reset_prefix_cache() == (True, "")
    assert manager.take_events() == [AllBlocksCleared()]
    assert manager.get_computed_blocks(make_request("b", list(range(10)))).num_tokens == 0
    manager.check_invariants()


def test_caching_disabled() -> None:
    manager = make_manager(enable_caching=False)
    a = make_request("a", list(range(10)))
    admit(manager, a)
    finish_step(manager, a, 10)
    assert all(block.block_hash is None for block in manager.block_pool.blocks)
    assert manager.get_computed_blocks(make_request("b", list(range(10)))).num_tokens == 0


def test_stats() -> None:
    manager = make_manager()
    a = make_request("a", list(range(10)))
    admit(manager, a)
    finish_step(manager, a, 10)
    admit(manager, make_request("b", list(range(10))))
    stats = manager.take_stats()
    assert stats.num_queries_tokens == 20 and stats.num_hit_tokens == 9
    assert stats.num_partial_hit_tokens == 1
    assert stats.hit_rate == 9 / 20 and stats.num_stored_blocks == 2
    assert manager.take_stats().num_queries_tokens == 0
    assert manager.stats.num_queries_tokens == 20
