"""Partial reuse from committed full blocks: a request that diverges from (or stops hitting) a full
block mid-block copies the KV of the tokens it shares; the source stays a cached full block."""

from __future__ import annotations

from kvmemo.kv.events import BlockRemoved
from kvmemo.kv.manager import BlockCopy, KVCacheManager
from kvmemo.kv.mm_items import MultiModalItem
from kvmemo.request import Request
from tests.kv.kv_testing import admit, finish_step, hit_ids, make_manager, make_request, ref_counts


def _four_blocks_a_freed(*, finish_filler: bool, **kwargs: bool) -> tuple[KVCacheManager, Request]:
    """A 4-block pool: A = | 0 1 2 3 | 4 5 6 7 | committed in blocks 0, 1 and freed; a filler
    then takes blocks 2 and 3 and, if finish_filler, computes and frees them."""
    manager = make_manager(num_blocks=4, **kwargs)
    a = make_request("a", list(range(8)))
    admit(manager, a)
    finish_step(manager, a)
    manager.free(a)
    filler = make_request("f", [70, 71, 72, 73, 74])
    admit(manager, filler)
    if finish_filler:
        finish_step(manager, filler)
        manager.free(filler)
    return manager, a


def test_same_prompt_of_full_blocks_twice_copies_all_but_the_last_token() -> None:
    manager = make_manager(num_blocks=10)
    pool = manager.block_pool
    a = make_request("a", list(range(12)))  # exactly 3 full blocks
    admit(manager, a)
    finish_step(manager, a)
    manager.free(a)
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]

    b = make_request("b", list(range(12)))
    prefix, new_ids = admit(manager, b)
    # The last-token rule stops the full hits at block 1; block 2 serves 3 of its 4 tokens.
    assert hit_ids(prefix) == [0, 1] and prefix.num_tokens == 11
    assert prefix.partial is not None and prefix.partial.block.block_id == 2
    assert prefix.partial.num_tokens == 3 and prefix.partial.source_hash == a.block_hashes[2]
    assert new_ids == [3]
    assert manager.take_copies() == [BlockCopy(src_block_id=2, dst_block_id=3, num_tokens=3)]
    assert manager.get_block_table("b") == [0, 1, 3]
    assert ref_counts(manager) == {0: 1, 1: 1, 3: 1}
    # The free source was kept out of the pops and rejoined the free queue at the tail.
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]
    assert pool.get_cached_block(a.block_hashes[2]) is pool.blocks[2]
    stats = manager.take_stats()
    assert stats.num_hit_tokens == 11 and stats.num_partial_hit_tokens == 3

    finish_step(manager, b, 1)  # one token computed; its full block 3 stays private (stored once)
    assert pool.blocks[3].block_hash is None
    manager.free(b)
    manager.check_invariants()


def test_same_prompt_while_the_first_still_runs_copies_from_a_referenced_block() -> None:
    manager = make_manager(num_blocks=10)
    a = make_request("a", list(range(12)))
    admit(manager, a)
    finish_step(manager, a)
    b = make_request("b", list(range(12)))
    prefix, new_ids = admit(manager, b)
    assert hit_ids(prefix) == [0, 1] and prefix.num_tokens == 11 and new_ids == [3]
    assert manager.take_copies() == [BlockCopy(2, 3, 3)]
    assert ref_counts(manager) == {0: 2, 1: 2, 2: 1, 3: 1}
    assert manager.block_pool.free_block_ids() == [4, 5, 6, 7, 8, 9]


def test_multi_turn_chat_copies_the_shared_part_of_the_answer_block() -> None:
    manager = make_manager(num_blocks=10, enable_events=True)
    pool = manager.block_pool
    a = make_request("a", [10, 11, 12, 13, 14, 15])  # turn 1
    admit(manager, a)
    finish_step(manager, a)
    for token in (20, 21, 22, 23, 24, 25):  # the answer, decoded one token per step
        a.append_output_token(token)
        manager.allocate_slots(a, 1)
        finish_step(manager, a, 1)
    a.append_output_token(26)  # EOS: sampled, never computed
    assert manager.get_block_table("a") == [0, 1, 2]  # | 10 11 12 13 | 14 15 20 21 | 22 23 24 25 |
    manager.free(a)
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    manager.take_events()

    # Turn 2 keeps the answer up to 23, then the template differs from what the model generated.
    b = make_request("b", [10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 90, 91, 92, 93, 94])
    prefix, new_ids = admit(manager, b)
    assert hit_ids(prefix) == [0, 1] and prefix.num_tokens == 10
    assert prefix.partial is not None and prefix.partial.block.block_id == 2
    assert prefix.partial.num_tokens == 2
    assert new_ids == [3, 4]
    assert manager.take_copies() == [BlockCopy(src_block_id=2, dst_block_id=3, num_tokens=2)]
    assert manager.get_block_table("b") == [0, 1, 3, 4]
    assert ref_counts(manager) == {0: 1, 1: 1, 3: 1, 4: 1}
    assert pool.free_block_ids() == [5, 6, 7, 8, 9, 2]
    assert manager.take_events() == []  # nothing evicted
    finish_step(manager, b)  # block 3 = | 22 23 90 91 | committed, chained like block 2

    # Turn 1's answer block is still a full hit.
    again = make_request("again", a.all_token_ids[:12] + [0])
    assert hit_ids(manager.get_computed_blocks(again)) == [0, 1, 2]
    # Between the two blocks chained from block 1: the longest prefix wins ...
    probe = manager.get_computed_blocks(make_request("p", b.all_token_ids[:10] + [90, 5, 5]))
    assert probe.partial is not None and probe.partial.block.block_id == 3
    assert probe.partial.num_tokens == 3
    # ... and on a tie the referenced block 3 beats the free block 2 (no free-queue disturbance).
    tie = make_request("t", b.all_token_ids[:10] + [7, 7])
    prefix = manager.get_computed_blocks(tie)
    assert prefix.partial is not None and prefix.partial.block.block_id == 3
    assert prefix.partial.num_tokens == 2
    manager.free(b)  # both free now: the oldest commit wins
    prefix = manager.get_computed_blocks(tie)
    assert prefix.partial is not None and prefix.partial.block.block_id == 2


def test_a_free_full_source_is_not_the_destination_and_stays_a_full_hit() -> None:
    manager, _ = _four_blocks_a_freed(finish_filler=True)
    pool = manager.block_pool
    assert pool.free_block_ids() == [1, 0, 3, 2]  # the source, block 1, is the LRU head

    b = make_request("b", [0, 1, 2, 3, 4, 5, 6, 60])
    prefix, new_ids = admit(manager, b)
    assert hit_ids(prefix) == [0] and prefix.num_tokens == 7
    assert prefix.partial is not None and prefix.partial.block.block_id == 1
    assert new_ids == [3]  # not block 1, though it was the head
    assert manager.take_copies() == [BlockCopy(src_block_id=1, dst_block_id=3, num_tokens=3)]
    assert pool.free_block_ids() == [2, 1]
    assert ref_counts(manager) == {0: 1, 3: 1}
    finish_step(manager, b)

    probe = make_request("p", list(range(8)) + [9])
    assert hit_ids(manager.get_computed_blocks(probe)) == [0, 1]
    manager.free(b)
    manager.check_invariants()


def test_a_free_full_source_is_adopted_when_every_free_block_is_needed() -> None:
    manager, a = _four_blocks_a_freed(finish_filler=False, enable_events=True)  # f holds 2, 3
    pool = manager.block_pool
    assert pool.free_block_ids() == [1, 0]
    manager.take_events()

    # 1 free hit + 1 new block = all free blocks: block 1 would be popped (evicted) anyway, so it
    # becomes b's block with its first 3 slots kept; no copy, and admission does not fail.
    b = make_request("b", [0, 1, 2, 3, 4, 5, 6, 60])
    prefix, new_ids = admit(manager, b)
    assert hit_ids(prefix) == [0] and prefix.num_tokens == 7
    assert new_ids == [1] and manager.take_copies() == []
    assert manager.get_block_table("b") == [0, 1] and pool.free_block_ids() == []
    assert manager.take_events() == [BlockRemoved(block_hashes=(a.block_hashes[1],))]
    assert pool.get_cached_block(a.block_hashes[1]) is None
    assert manager.stats.num_partial_hit_tokens == 3 and manager.stats.num_evicted_blocks == 1
    finish_step(manager, b)
    assert pool.blocks[1].block_hash == b.block_hashes[1]


def test_a_full_source_that_does_not_fit_changes_nothing() -> None:
    manager, a = _four_blocks_a_freed(finish_filler=False)  # f holds 2 and 3; free: 1 0
    pool = manager.block_pool
    big = make_request("big", [0, 1, 2, 3, 4, 5, 6, 60, 61])  # 1 free hit + 2 new > 2 free
    prefix = manager.get_computed_blocks(big)
    assert prefix.partial is not None and prefix.partial.block.block_id == 1
    assert manager.allocate_slots(big, 2, prefix) is None
    assert pool.free_block_ids() == [1, 0] and manager.take_copies() == []
    assert pool.get_cached_block(a.block_hashes[1]) is pool.blocks[1]
    manager.check_invariants()


def test_a_full_source_needs_equal_parent_and_extra_keys() -> None:
    manager = make_manager(num_blocks=40)
    cat = [MultiModalItem(5, 2, b"cat")]
    for rid, kwargs in [("l", {"cache_salt": "x"}), ("s", {"cache_salt": "t1"}), ("i", {})]:
        req = make_request(rid, list(range(8)), mm_items=cat if rid == "i" else None, **kwargs)
        admit(manager, req)
        finish_step(manager, req)

    def num_hit(tokens: list[int], **kwargs: object) -> int:
        return manager.get_computed_blocks(make_request("q", tokens, **kwargs)).num_tokens

    assert num_hit([0, 1, 2, 9], cache_salt="x") == 3  # block 0 of "l", partially
    assert num_hit([0, 1, 2, 9], cache_salt="t1") == 3
    assert num_hit([0, 1, 2, 9], cache_salt="t2") == 0
    assert num_hit([0, 1, 2, 9], cache_salt="y") == 0
    assert num_hit([0, 1, 2, 9]) == 3  # block 0 of "i": its image starts in block 1
    assert num_hit(list(range(7)) + [9], cache_salt="x") == 7
    assert num_hit(list(range(7)) + [9], cache_salt="y") == 0
    assert num_hit(list(range(7)) + [9], mm_items=cat) == 7
    assert num_hit(list(range(7)) + [9], mm_items=[MultiModalItem(5, 2, b"dog")]) == 4
    assert num_hit(list(range(7)) + [9]) == 4  # no image: block 1 of "i" does not match
    # Same tokens after another parent: block 1 of a different chain is never a source.
    assert num_hit([5, 5, 5, 5, 4, 5, 6, 9]) == 0


def test_no_partial_reuse_of_full_blocks_when_disabled() -> None:
    manager = make_manager(enable_partial_reuse=False)
    a = make_request("a", list(range(12)))
    admit(manager, a)
    finish_step(manager, a)
    prefix = manager.get_computed_blocks(make_request("b", list(range(12))))
    assert prefix.partial is None and prefix.num_tokens == 8
