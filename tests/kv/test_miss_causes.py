"""Every miss explained (kv/miss_causes.py): each cause from a scenario built to cause it, and on
a mixed random workload the causes of every request add up to its uncached prompt tokens."""

from __future__ import annotations

import random

import pytest

from kvmemo.kv.eviction import EVICTION_POLICIES
from kvmemo.kv.manager import KVCacheManager
from kvmemo.kv.miss_causes import explain_misses
from kvmemo.kv.miss_ledger import CAUSES, MissReport
from kvmemo.kv.retention import Retention
from kvmemo.request import Request
from kvmemo.sampling import SamplingParams
from tests.kv.kv_testing import admit, finish_step, make_manager, make_request
from tests.kv.test_retention import FakeClock

A = list(range(1, 13))  # three full 4-token blocks


def _serve(manager: KVCacheManager, request: Request, reply: list[int] = ()) -> MissReport:
    """Runs the request as the scheduler would, generating `reply`; returns its report,
    checked to add up."""
    prefix, new = admit(manager, request)
    assert new is not None, "no room"
    report = explain_misses(manager, request, prefix.num_tokens)
    assert report.num_tokens == request.num_prompt_tokens - prefix.num_tokens, report
    finish_step(manager, request)
    for token in reply:  # one decode step each
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1) is not None
        finish_step(manager, request, 1)
    manager.retain(request)
    manager.free(request)
    return report


def _flood(manager: KVCacheManager, start: int = 1000) -> None:
    for i in range(manager.num_blocks):
        _serve(manager, make_request(f"flood{start}-{i}", [start + 10 * i + j for j in range(8)]))


def test_a_new_prompt_was_never_seen_and_its_tail_is_partial() -> None:
    report = _serve(make_manager(), make_request("a", A[:10]))
    assert report.tokens == {"never_seen": 8, "partial_tail": 2}
    assert report.diverged_at is None and report.eviction_policy == "lru"


def test_the_same_prompt_again_computes_only_its_last_token() -> None:
    manager = make_manager()
    _serve(manager, make_request("a", A))
    assert _serve(manager, make_request("b", A)).tokens == {"last_token": 1}


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_flooded_prefix_was_evicted(policy: str) -> None:
    manager = make_manager(eviction_policy=policy)
    _serve(manager, make_request("a", A))
    _flood(manager)
    report = _serve(manager, make_request("b", A + [77, 78]))
    assert report.tokens == {"evicted": 12, "partial_tail": 2}
    assert report.eviction_policy == policy


def test_a_prefix_whose_retention_ran_out_says_so() -> None:
    manager = make_manager()
    clock = FakeClock()
    manager.block_pool.retention.clock = clock
    manager.max_retained_blocks = 5
    a = make_request("a", A)
    a.retention = (Retention(8, 60),)  # its first two blocks
    _serve(manager, a)
    clock.now += 61
    _flood(manager)
    report = _serve(manager, make_request("b", A + [77]))
    assert report.tokens == {"expired_retention": 8, "evicted": 4, "partial_tail": 1}


def test_a_prompt_that_leaves_a_cached_chain_names_the_token() -> None:
    manager = make_manager()
    _serve(manager, make_request("a", A))
    b = A[:6] + [90, 91, 92, 93, 94, 95]  # differs from token 6 on
    report = _serve(manager, make_request("b", b))
    # Block 0 is hit, tokens 4-5 are copied from A's block 1 (a partial hit): the rest of
    # that block diverged, at token 6; the last block is new.
    assert report.tokens == {"diverged": 2, "never_seen": 4}
    assert report.diverged_at == 6
    plain = make_manager(enable_partial_reuse=False)
    _serve(plain, make_request("a", A))
    report = _serve(plain, make_request("b", b))
    assert report.tokens == {"diverged": 4, "never_seen": 4} and report.diverged_at == 6


def test_a_history_that_re_renders_a_reply_is_template_drift() -> None:
    """Turn 2 carries turn 1's reply in other tokens (a template dropped its reasoning): the
    miss starts at the reply's first token, and says so."""
    manager = make_manager()
    turn1 = A[:6]
    _serve(manager, make_request("t1", turn1), reply=[40, 41, 42, 43, 44, 45, 46, 47])
    drifted = turn1 + [46, 47, 50, 51, 52, 53]  # the reply's first tokens dropped
    report = _serve(manager, make_request("t2", drifted))
    assert report.diverged_at == 6
    assert report.tokens == {"template_drift": 2, "never_seen": 4}
    # the same history kept as generated reuses it all; an edited prompt is only diverged
    kept = _serve(manager, make_request("t3", turn1 + [40, 41, 42, 43, 44, 45, 46, 47, 60]))
    assert kept.tokens == {"last_token": 1}
    edited = _serve(manager, make_request("t4", A[:4] + [99, 6, 40, 41, 7]))
    assert edited.tokens == {"diverged": 4, "partial_tail": 1} and edited.diverged_at == 4


def test_another_tenants_copy_is_named() -> None:
    manager = make_manager()
    _serve(manager, make_request("a", A, cache_salt="tenant-x"))
    report = _serve(manager, make_request("b", A + [5], cache_salt="tenant-y"))
    assert report.tokens == {"other_salt": 12, "partial_tail": 1}
    # a request's own answer must not tell one tenant what another cached
    assert report.for_the_client() == {"never_seen": 12, "partial_tail": 1}
    # the unsalted requests are a tenant of their own too
    assert _serve(manager, make_request("c", A + [5])).tokens == {"other_salt": 12,
                                                                   "partial_tail": 1}


def test_a_request_for_prompt_logprobs_skips_the_cache() -> None:
    manager = make_manager()
    _serve(manager, make_request("a", A))
    b = make_request("b", A)
    b.sampling_params = SamplingParams(prompt_logprobs=1)
    assert _serve(manager, b).tokens == {"cache_skipped": 12}


def test_causes_add_up_on_a_mixed_workload_and_in_the_totals() -> None:
    """Shared prefixes, salts, floods, retention and prompt logprobs, at random: every request's
    causes add up (checked in _serve), and the ledger's totals are their sum."""
    rng = random.Random(7)
    manager = make_manager(num_blocks=16)
    clock = FakeClock()
    manager.block_pool.retention.clock = clock
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(6)]
    expected: dict[str, int] = dict.fromkeys(CAUSES, 0)
    seen: set[str] = set()
    for i in range(300):
        stem = rng.choice(stems)
        tokens = stem[: rng.randrange(1, len(stem) + 1)] + [
            rng.randrange(50) for _ in range(rng.randrange(0, 10))]
        request = make_request(f"r{i}", tokens, cache_salt=rng.choice([None, None, "s1", "s2"]))
        if rng.random() < 0.05:
            request.sampling_params = SamplingParams(prompt_logprobs=0)
        if rng.random() < 0.2:
            request.retention = (Retention(rng.randrange(len(tokens) + 1), rng.choice([5, 50])),)
        clock.now += rng.random() * 5
        try:
            manager.check_retention(request)
        except ValueError:
            request.retention = ()
        reply = [rng.randrange(50) for _ in range(rng.choice([0, 0, 3, 6]))]
        if rng.random() < 0.3:  # the next turn: this history, its reply re-rendered or not
            history = tokens + (reply if rng.random() < 0.5 else reply[1:])
            stems.append(history + [rng.randrange(50) for _ in range(3)])
        report = _serve(manager, request, reply)
        for cause, count in report.tokens.items():
            expected[cause] += count
        seen.update(report.tokens)
    assert dict(manager.block_pool.misses.totals) == {c: n for c, n in expected.items() if n}
    assert seen == set(CAUSES)  # the workload meets every cause
