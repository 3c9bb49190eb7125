"""Routing policies on plain candidates: longest prefix, balance, cold spreading, round robin."""

from __future__ import annotations

from collections import Counter

import pytest

from kvmemo.routing.policy import Candidate, RoutingPolicy


def test_longest_prefix_wins():
    policy = RoutingPolicy("prefix")
    d = policy.choose([Candidate(0, 3, 0), Candidate(1, 7, 2), Candidate(2, 0, 0)])
    assert (d.index, d.matched_blocks, d.reason) == (1, 7, "prefix")


def test_prefix_tie_goes_to_the_least_loaded_holder():
    policy = RoutingPolicy("prefix")
    for _ in range(4):
        d = policy.choose([Candidate(0, 5, 3), Candidate(1, 5, 1), Candidate(2, 0, 0)])
        assert (d.index, d.reason) == (1, "prefix")


def test_an_overloaded_holder_is_bypassed():
    policy = RoutingPolicy("prefix", balance_threshold=2)
    assert policy.choose([Candidate(0, 9, 2), Candidate(1, 0, 0)]).index == 0
    d = policy.choose([Candidate(0, 9, 3), Candidate(1, 0, 0)])
    assert (d.index, d.reason) == (1, "balance")


def test_cold_prompts_spread_over_idle_replicas():
    policy = RoutingPolicy("prefix")
    picks = Counter(policy.choose([Candidate(i, 0, 0) for i in range(3)]).index for _ in range(30))
    assert picks == {0: 10, 1: 10, 2: 10}
    d = policy.choose([Candidate(0, 0, 2), Candidate(1, 0, 1)])
    assert (d.index, d.reason) == (1, "cold")


def test_round_robin_ignores_the_cache():
    policy = RoutingPolicy("round_robin")
    picks = [policy.choose([Candidate(0, 9, 0), Candidate(1, 0, 0)]).index for _ in range(4)]
    assert sorted(picks) == [0, 0, 1, 1]


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        RoutingPolicy("random")
    with pytest.raises(ValueError, match="balance_threshold"):
        RoutingPolicy("prefix", balance_threshold=-1)
    with pytest.raises(ValueError, match="no healthy replica"):
        RoutingPolicy().choose([])
