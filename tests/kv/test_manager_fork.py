"""Beam forks: shared blocks by ref count, copy-on-write of a shared partial block, and publishing
only the final beams' blocks (block_size 4, exact block ids, invariants after every operation)."""

from __future__ import annotations

import random

import pytest

from kvmemo.kv.events import BlockStored
from kvmemo.kv.manager import KVCacheManager
from kvmemo.kv.match import BlockCopy
from kvmemo.request import Request
from tests.kv.kv_testing import admit, finish_step, make_manager, make_request, ref_counts

Memory = dict[int, list[int | None]]  # block id -> the token whose KV each slot holds


def child_of(parent: Request, request_id: str, token: int) -> Request:
    """A beam continuing `parent` with `token` (whose KV is not computed yet)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=parent.prompt_token_ids,
        sampling_params=parent.sampling_params,
        output_token_ids=[*parent.output_token_ids, token],
        all_token_ids=[*parent.all_token_ids, token],
        block_hashes=list(parent.block_hashes),
        num_computed_tokens=parent.num_tokens,
        hasher=parent.hasher,
    )


def fork(manager: KVCacheManager, parent: Request, request_id: str, token: int) -> Request:
    child = child_of(parent, request_id, token)
    manager.fork(parent, child)
    manager.check_invariants()
    return child


def decode(manager: KVCacheManager, beam: Request) -> list[int] | None:
    """Schedule the beam's last token; beams do not commit (the step just advances them)."""
    new_ids = manager.allocate_slots(beam, beam.num_tokens - beam.num_computed_tokens)
    manager.check_invariants()
    return new_ids


def test_fork_shares_blocks_and_copies_the_partial_tail_on_write() -> None:
    manager = make_manager(num_blocks=10, enable_events=True)
    root = make_request("root", list(range(10)))  # | 0 1 2 3 | 4 5 6 7 | 8 9 . . |
    admit(manager, root)
    finish_step(manager, root)
    assert len(manager.take_events()) == 2  # the prompt's full blocks, as usual
    # The prompt's partial tail is a partial-reuse source while it has a single owner.
    probe = make_request("probe", list(range(10)) + [50])
    assert manager.get_computed_blocks(probe).num_tokens == 10

    a = fork(manager, root, "a", 100)
    b = fork(manager, root, "b", 101)
    assert manager.get_block_table("a") == manager.get_block_table("b") == [0, 1, 2]
    assert ref_counts(manager) == {0: 3, 1: 3, 2: 3}
    # Shared now: no longer a partial-reuse source (its owners are about to write into it).
    assert manager.get_computed_blocks(probe).num_tokens == 8
    manager.free(root)
    manager.check_invariants()
    assert ref_counts(manager) == {0: 2, 1: 2, 2: 2}

    # The first writer into the shared partial block copies its two computed slots.
    assert decode(manager, a) == []
    assert manager.get_block_table("a") == [0, 1, 3]
    assert manager.take_copies() == [BlockCopy(src_block_id=2, dst_block_id=3, num_tokens=2)]
    assert ref_counts(manager) == {0: 2, 1: 2, 2: 1, 3: 1}
    # The last holder writes in place: no copy.
    assert decode(manager, b) == []
    assert manager.get_block_table("b") == [0, 1, 2]
    assert manager.take_copies() == []
    a.num_computed_tokens = b.num_computed_tokens = 11

    # a continues twice (in place), then forks at a block boundary: full blocks only, no copy.
    a.append_output_token(102)
    decode(manager, a)
    a.num_computed_tokens = 12  # | 8 9 100 102 | full
    c = fork(manager, a, "c", 103)
    a.append_output_token(104)
    assert decode(manager, c) == [4] and decode(manager, a) == [5]
    assert manager.take_copies() == []
    assert manager.get_block_table("a") == [0, 1, 3, 5]
    assert manager.get_block_table("c") == [0, 1, 3, 4]
    a.num_computed_tokens = c.num_computed_tokens = 13
    # Nothing a running beam filled was published.
    assert manager.take_events() == []

    # c wins, a and b are pruned: only c's generated full block is published.
    manager.finish_beams(final=[c], pruned=[a, b])
    manager.check_invariants()
    events = manager.take_events()
    assert [type(e) for e in events] == [BlockStored]
    assert events[0].token_ids == (8, 9, 100, 102)
    assert events[0].parent_block_hash == root.block_hashes[1]
    assert manager.num_free_blocks == 10
    # Pruned first (tail first), the final beam last: its blocks are evicted last.
    assert manager.block_pool.free_block_ids() == [6, 7, 8, 9, 5, 2, 4, 3, 1, 0]
    hit = manager.get_computed_blocks(make_request("next", [*c.all_token_ids[:12], 7]))
    assert hit.num_tokens == 12


def test_copy_on_write_needs_a_free_block() -> None:
    manager = make_manager(num_blocks=3)
    root = make_request("root", list(range(10)))
    admit(manager, root)
    finish_step(manager, root)
    a = fork(manager, root, "a", 100)
    before = (ref_counts(manager), manager.block_pool.free_block_ids())
    assert manager.num_free_blocks == 0
    assert decode(manager, a) is None  # the private copy does not fit: nothing changes
    assert (ref_counts(manager), manager.block_pool.free_block_ids()) == before
    assert manager.take_copies() == []
    manager.free(root)
    assert decode(manager, a) == []  # sole holder now: writes in place
    manager.free(a)
    manager.check_invariants()
    assert manager.num_free_blocks == 3


def test_fork_rejects_bad_input() -> None:
    manager = make_manager()
    root = make_request("root", list(range(6)))
    admit(manager, root)
    finish_step(manager, root)
    child = child_of(root, "x", 9)
    manager.fork(root, child)
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.fork(root, child)
    too_long = child_of(root, "y", 9)
    too_long.num_computed_tokens = 9
    with pytest.raises(ValueError, match="covering"):
        manager.fork(root, too_long)
    with pytest.raises(ValueError, match="covering"):
        manager.fork(make_request("unknown", [1]), child_of(root, "z", 9))
    manager.check_invariants()


@pytest.mark.parametrize("seed", range(12))
def test_random_beam_search_keeps_every_beams_kv(seed: int) -> None:
    """Random forks, prunes and decodes over a simulated KV memory: after every step each beam's
    block table reads back exactly its own tokens, and every block is free at the end."""
    rng = random.Random(seed)
    block_size = 4
    # Copy-on-write does not depend on prefix caching: every third seed runs with it off.
    manager = make_manager(
        num_blocks=64, block_size=block_size, enable_events=True, enable_caching=seed % 3 != 0
    )
    memory: Memory = {b: [None] * block_size for b in range(64)}
    root = make_request("root", [rng.randrange(50) for _ in range(rng.randrange(1, 11))])
    admit(manager, root)
    run_copies(manager, memory)
    write(manager, memory, root, 0)
    finish_step(manager, root)
    ids = iter(range(10_000))
    num_beams = rng.randint(1, 4)
    beams = [fork(manager, root, f"b{next(ids)}", rng.randrange(50)) for _ in range(num_beams)]
    manager.free(root)
    manager.check_invariants()
    for _ in range(rng.randrange(1, 14)):
        # As in a step: allocate every beam, run all block copies, then the forward writes.
        for beam in beams:
            assert decode(manager, beam) is not None
        run_copies(manager, memory)
        for beam in beams:
            write(manager, memory, beam, beam.num_computed_tokens)
            beam.num_computed_tokens = beam.num_tokens
        for beam in beams:
            table = manager.get_block_table(beam.request_id)
            stored = [
                memory[table[p // block_size]][p % block_size] for p in range(beam.num_tokens)
            ]
            assert stored == beam.all_token_ids
        # Next generation: each new beam continues a random parent; parents left out are pruned.
        parents = [rng.choice(beams) for _ in range(rng.randint(1, 4))]
        adopted: set[str] = set()
        next_beams = []
        for parent in parents:
            if parent.request_id in adopted:
                next_beams.append(fork(manager, parent, f"b{next(ids)}", rng.randrange(50)))
            else:
                next_beams.append(parent)  # adopted in place after the forks below
                adopted.add(parent.request_id)
        for beam in beams:
            if beam.request_id not in adopted:
                manager.free(beam)
                manager.check_invariants()
        for beam in next_beams:
            if beam.num_tokens == beam.num_computed_tokens:
                beam.append_output_token(rng.randrange(50))
        beams = next_beams
    events = manager.take_events()
    assert all(not isinstance(e, BlockStored) or len(e.token_ids) == block_size for e in events)
    final, pruned = beams[:1], beams[1:]
    manager.finish_beams(final, pruned)
    manager.check_invariants()
    assert manager.num_free_blocks == 64


def run_copies(manager: KVCacheManager, memory: Memory) -> None:
    for copy in manager.take_copies():
        memory[copy.dst_block_id][: copy.num_tokens] = memory[copy.src_block_id][: copy.num_tokens]


def write(manager: KVCacheManager, memory: Memory, request: Request, start: int) -> None:
    """The forward's KV write (here: the token itself) for positions start.. of `request`."""
    table = manager.get_block_table(request.request_id)
    size = manager.block_size
    for pos in range(start, request.num_tokens):
        memory[table[pos // size]][pos % size] = request.all_token_ids[pos]
