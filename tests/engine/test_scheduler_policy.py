"""Scheduler policies on the real KV manager, without a model: fast and exact."""

from __future__ import annotations

from kvmemo.engine.scheduler import Scheduler, SchedulerLimits
from kvmemo.kv.manager import KVCacheManager
from kvmemo.request import BlendSpec, Request, RequestStatus
from kvmemo.sampling import SamplingParams
from tests.kv.kv_testing import make_hasher, make_layout

BLOCK = 4


def make_scheduler(
    num_blocks: int = 64, budget: int = 64, max_seqs: int = 16, caching: bool = True
) -> Scheduler:
    kv = KVCacheManager(make_layout(num_blocks, BLOCK), enable_caching=caching)
    return Scheduler(SchedulerLimits(budget, max_seqs, 4096), kv)


def request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, tokens, params, hasher=make_hasher(BLOCK))


def run_step(scheduler: Scheduler, token: int = 7):
    """Schedule, pretend the model sampled `token` for every sampling sequence, update."""
    out = scheduler.schedule()
    sampled = {s.request_id: [token] for s in out.sequences if s.needs_sample}
    scheduler.update_from_output(out, sampled)
    return out


def test_request_shares_the_prefix_blocks_another_computes_in_the_same_step():
    scheduler = make_scheduler()
    shared = list(range(100, 120))  # 5 full blocks
    scheduler.add_request(request("a", shared + [1, 2]))
    scheduler.add_request(request("b", shared + [3, 4]))
    first = scheduler.schedule()
    a, b = first.sequences
    assert (a.request_id, a.num_computed_tokens, len(a.token_ids)) == ("a", 0, 22)
    # b computes only its own two tokens, over a's five blocks, written by the same forward.
    assert (b.request_id, b.num_computed_tokens, len(b.token_ids)) == ("b", 20, 2)
    assert b.block_table[:5] == a.block_table[:5]
    assert b.block_table[5] != a.block_table[5]
    scheduler.kv.check_invariants()
    scheduler.update_from_output(first, {"a": [7], "b": [7]})
    scheduler.kv.check_invariants()  # a committed the shared blocks; b holds them, uncommitted
    c = request("c", shared + [5, 6])
    assert scheduler.kv.get_computed_blocks(c).num_tokens == 20  # published after the step
    while scheduler.num_unfinished:
        run_step(scheduler)
    assert scheduler.kv.num_free_blocks == 64


def test_without_prefix_caching_requests_neither_share_nor_wait():
    scheduler = make_scheduler(caching=False)
    shared = list(range(100, 120))
    scheduler.add_request(request("a", shared + [1, 2]))
    scheduler.add_request(request("b", shared + [3, 4]))
    a, b = scheduler.schedule().sequences
    assert (b.request_id, b.num_computed_tokens, len(b.token_ids)) == ("b", 0, 22)
    assert not set(a.block_table) & set(b.block_table)


def test_a_block_completed_by_a_single_token_is_not_shared_in_its_step():
    scheduler = make_scheduler()
    scheduler.add_request(request("w", list(range(1, 8)), max_tokens=1))  # block 0 + 3 tokens
    while scheduler.num_unfinished:
        run_step(scheduler)
    scheduler.add_request(request("a", list(range(1, 9))))  # completes block 1 with one token
    scheduler.add_request(request("b", list(range(1, 10))))
    first = scheduler.schedule()
    # Sharing would make a step of one-token sequences only, which the fused decode path runs
    # writing each sequence's slot as it attends: b waits for the block to commit instead.
    assert [(s.request_id, len(s.token_ids)) for s in first.sequences] == [("a", 1)]
    scheduler.update_from_output(first, {"a": [7]})
    b = next(s for s in scheduler.schedule().sequences if s.request_id == "b")
    assert b.num_computed_tokens == 8


def test_blocks_a_blend_computes_are_not_shared_in_its_step():
    scheduler = make_scheduler()
    shared = list(range(100, 120))
    owner = request("blend", shared + [1, 2])
    # The runner computes blends after the step's other sequences: a sharer would read first.
    owner.blend = BlendSpec(context_len=20, chunk_ranges=[], chunk_requests=[],
                            recompute_ratio=0.15, check_layer=1)
    scheduler.add_request(owner)
    scheduler.add_request(request("b", shared + [3, 4]))
    assert [s.request_id for s in scheduler.schedule().sequences] == ["blend"]


def test_request_waits_when_the_shared_blocks_are_not_all_computed_this_step():
    scheduler = make_scheduler(budget=12)
    shared = list(range(100, 120))  # 5 full blocks; a's first chunk computes 3 of them
    scheduler.add_request(request("a", shared + [1, 2]))
    scheduler.add_request(request("b", shared + [3, 4]))
    first = run_step(scheduler)
    # Sharing 3 blocks would leave b's next block in flight (a computes it next step): b waits
    # instead of computing it a second time.
    assert [s.request_id for s in first.sequences] == ["a"]
    second = run_step(scheduler)
    b = next(s for s in second.sequences if s.request_id == "b")
    assert b.num_computed_tokens == 20  # three blocks committed, two shared in flight
    assert b.block_table[:5] == next(s for s in second.sequences if s.request_id == "a").block_table[:5]


def test_requests_sharing_an_uncomputed_prompt_follow_the_first_of_them():
    scheduler = make_scheduler(budget=30)
    shared = list(range(100, 120))
    scheduler.add_request(request("a1", shared + [1, 2]))
    scheduler.add_request(request("long", list(range(300, 328))))
    scheduler.add_request(request("a2", shared + [3, 4]))
    out = scheduler.schedule()
    # a2 costs two tokens beside a1; arrival order would give the budget to "long" first.
    assert [(s.request_id, len(s.token_ids)) for s in out.sequences] == [
        ("a1", 22), ("a2", 2), ("long", 6)
    ]


def test_cached_prefix_goes_first_when_the_budget_is_tight():
    scheduler = make_scheduler(budget=24)
    warm_prefix = list(range(200, 220))
    scheduler.add_request(request("warmup", warm_prefix + [9], max_tokens=1))
    while scheduler.num_unfinished:
        run_step(scheduler)
    scheduler.add_request(request("cold", list(range(300, 330))))
    scheduler.add_request(request("hit", warm_prefix + [5, 6]))
    out = scheduler.schedule()
    assert out.sequences[0].request_id == "hit"
    assert out.sequences[0].num_computed_tokens == 20


def test_newest_request_is_preempted_and_everything_finishes():
    scheduler = make_scheduler(num_blocks=6, budget=64)
    scheduler.add_request(request("old", list(range(10, 18)), max_tokens=8))  # up to 16 tokens: 4 blocks
    scheduler.add_request(request("new", list(range(30, 36)), max_tokens=8))  # up to 14 tokens: 4 blocks
    preempted: list[str] = []
    for _ in range(100):
        if not scheduler.num_unfinished:
            break
        preempted += run_step(scheduler).preempted_request_ids
    assert not scheduler.num_unfinished
    assert preempted and set(preempted) == {"new"}
    scheduler.kv.check_invariants()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_finishing_a_waiting_request_removes_it():
    scheduler = make_scheduler()
    scheduler.add_request(request("x", [1, 2, 3]))
    scheduler.finish_request("x", RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_unfinished == 0 and not scheduler.schedule().sequences
