"""Partial reuse: a partially filled block's computed KV is copied (or adopted), never shared."""

from __future__ import annotations

from kvmemo.kv.manager import BlockCopy
from tests.kv.kv_testing import admit, finish_step, hit_ids, make_manager, make_request, ref_counts


def _running_a(manager, tokens=(0, 1, 2, 3, 4, 5, 6, 7, 8, 9)):  # type: ignore[no-untyped-def]
    a = make_request("a", list(tokens))
    admit(manager, a)
    finish_step(manager, a)  # blocks 0, 1 committed; block 2 holds [8 9] computed
    return a


def test_partial_match_is_copied_into_a_fresh_block() -> None:
    manager = make_manager()
    a = _running_a(manager)
    b = make_request("b", list(range(9)) + [50, 51])  # shares [8] of A's third block
    prefix, new_ids = admit(manager, b)
    assert hit_ids(prefix) == [0, 1]
    assert prefix.partial is not None
    assert prefix.partial.block.block_id == 2 and prefix.partial.num_tokens == 1
    assert prefix.num_tokens == 9
    assert new_ids == [3]
    assert manager.take_copies() == [BlockCopy(src_block_id=2, dst_block_id=3, num_tokens=1)]
    assert manager.take_copies() == []
    assert manager.get_block_table("a") == [0, 1, 2] and manager.get_block_table("b") == [0, 1, 3]
    assert ref_counts(manager) == {0: 2, 1: 2, 2: 1, 3: 1}  # src still A's alone
    finish_step(manager, b)
    # A keeps writing its block; B's copy is its own.
    a.append_output_token(10)
    manager.allocate_slots(a, 1)
    finish_step(manager, a, 1)
    assert manager.block_pool.blocks[2].block_hash is None  # [8 9 10] not full yet


def test_longest_partial_wins_and_last_token_is_kept() -> None:
    manager = make_manager(num_blocks=20)
    _running_a(manager)  # block 2 holds [8 9]
    c = make_request("c", list(range(10)) + [7])
    admit(manager, c)
    finish_step(manager, c)  # c's block 5? holds [8 9 7]
    probe = make_request("p", list(range(10)) + [7, 7])
    prefix = manager.get_computed_blocks(probe)
    assert prefix.partial is not None and prefix.partial.num_tokens == 3
    assert prefix.num_tokens == 11
    same = make_request("s", list(range(10)) + [7])  # the whole of c: leave its last token
    prefix = manager.get_computed_blocks(same)
    assert prefix.partial is not None and prefix.partial.num_tokens == 2 and prefix.num_tokens == 10


def test_partial_reuse_can_be_disabled() -> None:
    manager = make_manager(enable_partial_reuse=False)
    _running_a(manager)
    prefix = manager.get_computed_blocks(make_request("b", list(range(9)) + [50]))
    assert hit_ids(prefix) == [0, 1] and prefix.partial is None and prefix.num_tokens == 8


def test_a_free_partial_block_is_adopted_not_handed_out_as_a_destination() -> None:
    manager = make_manager(num_blocks=4)
    a = _running_a(manager)  # blocks 0, 1, 2 (2 partial: [8 9]); block 3 free
    manager.free(a)
    assert manager.block_pool.free_block_ids() == [3, 2, 1, 0]
    b = make_request("b", list(range(10)) + [60, 61, 62, 63, 64])  # 4 blocks: exactly the pool
    prefix, new_ids = admit(manager, b)
    assert hit_ids(prefix) == [0, 1] and prefix.partial is not None
    assert prefix.partial.block.block_id == 2 and prefix.num_tokens == 10
    # Block 2 is B's own now (its KV is in place: no copy) and block 3 is fresh.
    assert new_ids == [2, 3] and manager.take_copies() == []
    assert manager.get_block_table("b") == [0, 1, 2, 3]
    assert manager.num_free_blocks == 0
    finish_step(manager, b)
    manager.free(b)
    manager.check_invariants()


def test_a_popped_partial_block_is_forgotten() -> None:
    manager = make_manager(num_blocks=4)
    a = _running_a(manager)
    manager.free(a)  # free queue: 3 2 1 0
    filler = make_request("f", [70, 71, 72, 73, 74])  # pops 3 and 2: block 2's KV is rewritten
    admit(manager, filler)
    prefix = manager.get_computed_blocks(make_request("b", list(range(10)) + [1]))
    assert prefix.partial is None and prefix.num_tokens == 8


def test_partial_entry_needs_equal_extra_keys() -> None:
    manager = make_manager()
    a = make_request("a", [0, 1, 2], cache_salt="t1")
    admit(manager, a)
    finish_step(manager, a)  # block 0 holds [0 1 2] (salted, chained from the root)

    def num_hit(**kwargs: str) -> int:
        return manager.get_computed_blocks(make_request("b", [0, 1, 5], **kwargs)).num_tokens

    assert num_hit(cache_salt="t1") == 2
    assert num_hit(cache_salt="t2") == 0 and num_hit() == 0 and num_hit(cache_salt="x") == 0


def test_partial_entry_holds_only_computed_tokens() -> None:
    manager = make_manager()
    a = make_request("a", list(range(7)))
    admit(manager, a, 5)  # scheduled 5: block 1 will hold [4] once computed
    finish_step(manager, a, 5)
    manager.allocate_slots(a, 2)  # [5 6] scheduled but not computed
    probe = make_request("p", list(range(7)) + [9])
    assert manager.get_computed_blocks(probe).num_tokens == 5
    finish_step(manager, a, 2)
    assert manager.get_computed_blocks(probe).num_tokens == 7
