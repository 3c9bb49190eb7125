"""Scheduler policies on the real KV manager, without a model: fast and exact."""

from __future__ import annotations

from kvmemo.engine.scheduler import Scheduler, SchedulerLimits
from kvmemo.kv.manager import KVCacheManager
from kvmemo.request import Request, RequestStatus
from kvmemo.sampling import SamplingParams
from tests.kv.kv_testing import make_hasher, make_layout

BLOCK = 4


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_seqs: int = 16) -> Scheduler:
    kv = KVCacheManager(make_layout(num_blocks, BLOCK))
    return Scheduler(SchedulerLimits(budget, max_seqs, 4096), kv)


def request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, tokens, params, hasher=make_hasher(BLOCK))


def run_step(scheduler: Scheduler, token: int = 7):
    """Schedule, pretend the model sampled `token` for every sampling sequence, update."""
    out = scheduler.schedule()
    sampled = {s.request_id: token for s in out.sequences if s.needs_sample}
    scheduler.update_from_output(out, sampled)
    return out


def test_request_sharing_an_in_flight_prefix_waits_one_step_then_hits():
    scheduler = make_scheduler()
    shared = list(range(100, 120))  # 5 full blocks
    scheduler.add_request(request("a", shared + [1, 2]))
    scheduler.add_request(request("b", shared + [3, 4]))
    first = run_step(scheduler)
    assert [s.request_id for s in first.sequences] == ["a"]  # b would recompute a's blocks
    second = run_step(scheduler)
    b = next(s for s in second.sequences if s.request_id == "b")
    assert b.num_computed_tokens == 20  # all of a's shared blocks, committed after step 1


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
