"""Retention (kv/retention.py): a retained prefix survives a flood, expires on time, refreshes
on use, stays within its cache_salt's quota, and never holds the pool against new work."""

from __future__ import annotations

import pytest

from kvmemo.errors import InputError
from kvmemo.kv.manager import KVCacheManager
from kvmemo.kv.retention import Retention
from kvmemo.request import Request
from tests.kv.kv_testing import admit, finish_step, make_manager, make_request


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _manager(num_blocks: int = 10) -> tuple[KVCacheManager, FakeClock]:
    manager = make_manager(num_blocks)  # 4-token blocks
    clock = FakeClock()
    manager.block_pool.retention.clock = clock
    manager.max_retained_blocks = 5
    return manager, clock


def _serve(manager: KVCacheManager, request: Request) -> int:
    """Runs the request to its end as the scheduler would; returns its cached prompt tokens."""
    prefix, new = admit(manager, request)
    assert new is not None, "no room"
    finish_step(manager, request)
    manager.retain(request)
    manager.free(request)
    manager.check_invariants()
    return prefix.num_tokens


def _flood(manager: KVCacheManager, start: int) -> None:
    """Enough one-off 2-block prompts to cycle the whole pool twice."""
    for i in range(manager.num_blocks):
        tokens = [start + 10 * i + j for j in range(8)]
        _serve(manager, make_request(f"flood{start}-{i}", tokens))


PROMPT = list(range(1, 13))  # three full blocks


def _asking(prompt: list[int], seconds: float | None, rid: str, salt: str | None = None,
            num_tokens: int = 12) -> Request:
    request = make_request(rid, prompt, cache_salt=salt)
    if seconds is not None:
        request.retention = (Retention(num_tokens, seconds),)
    return request


def test_a_flood_evicts_an_unretained_prefix() -> None:
    """The control: without retention the flood below leaves nothing of the prompt."""
    manager, _ = _manager()
    _serve(manager, _asking(PROMPT, None, "a"))
    _flood(manager, 100)
    assert _serve(manager, _asking(PROMPT + [99], None, "again")) == 0


def test_a_retained_prefix_survives_the_flood_then_expires_on_time() -> None:
    manager, clock = _manager()
    _serve(manager, _asking(PROMPT, 60, "a"))
    assert manager.block_pool.retained_blocks("") == 3
    clock.now += 59
    _flood(manager, 100)
    assert _serve(manager, _asking(PROMPT + [99], None, "again")) == 12
    clock.now += 2  # 61 s after the first request: expired (the plain hit did not refresh it)
    assert manager.block_pool.retained_blocks("") == 0
    _flood(manager, 300)
    assert _serve(manager, _asking(PROMPT + [99], None, "late")) == 0
    assert manager.block_pool.num_retained_evicted == 0


def test_a_retained_use_refreshes_the_time() -> None:
    manager, clock = _manager()
    _serve(manager, _asking(PROMPT, 60, "a"))
    clock.now += 50
    assert _serve(manager, _asking(PROMPT + [7], 60, "b")) == 12  # retained again until 110
    clock.now += 50  # 100 s after the first: past its time, within the second's
    _flood(manager, 100)
    assert _serve(manager, _asking(PROMPT + [8], None, "c")) == 12
    clock.now += 11
    _flood(manager, 300)
    assert _serve(manager, _asking(PROMPT + [9], None, "d")) == 0


def test_only_the_range_is_retained() -> None:
    manager, _ = _manager()
    _serve(manager, _asking(PROMPT, 60, "a", num_tokens=6))  # one full block of the three
    assert manager.block_pool.retained_blocks("") == 1
    _flood(manager, 100)
    assert _serve(manager, _asking(PROMPT + [99], None, "again")) == 4


def test_retained_blocks_go_last_but_never_hold_the_pool() -> None:
    """A request needing every block gets them: the retained ones are evicted (and counted)."""
    manager, _ = _manager(num_blocks=6)
    manager.max_retained_blocks = 6
    _serve(manager, _asking(PROMPT, 60, "a"))
    whole = [500 + i for i in range(24)]  # six blocks: the whole pool
    assert _serve(manager, make_request("big", whole)) == 0
    assert manager.block_pool.num_retained_evicted == 3
    assert manager.block_pool.retained_blocks("") == 0


def test_the_quota_names_its_limit_and_counts_per_cache_salt() -> None:
    manager, _ = _manager()
    manager.max_retained_blocks = 3
    _serve(manager, _asking(PROMPT, 60, "a", salt="tenant"))
    # The same prefix again adds nothing: allowed, and refreshed.
    manager.check_retention(_asking(PROMPT + [5], 60, "b", salt="tenant"))
    other = [50 + i for i in range(8)]
    with pytest.raises(InputError, match=r"limit is 12 tokens per cache_salt") as error:
        manager.check_retention(_asking(other, 60, "c", salt="tenant", num_tokens=8))
    assert error.value.param == "retention"
    assert "12 held now, 8 more asked" in str(error.value)
    # Another tenant has its own quota; a prompt's partial tail block is never counted.
    manager.check_retention(_asking(other, 60, "d", salt="other", num_tokens=8))
    manager.check_retention(_asking(other[:3], 60, "e", salt="tenant", num_tokens=3))


def test_the_quota_holds_when_requests_race_past_the_check() -> None:
    """Two requests checked before either ended: the second retains only what fits."""
    manager, _ = _manager()
    manager.max_retained_blocks = 4
    first, second = _asking(PROMPT, 60, "a"), _asking([70 + i for i in range(12)], 60, "b")
    manager.check_retention(first)
    manager.check_retention(second)
    _serve(manager, first)
    _serve(manager, second)
    assert manager.block_pool.retained_blocks("") == 4
    _flood(manager, 100)
    assert _serve(manager, _asking([70 + i for i in range(12)] + [1], None, "c")) == 4


def test_retention_ends_with_a_prefix_cache_reset() -> None:
    manager, _ = _manager()
    _serve(manager, _asking(PROMPT, 60, "a"))
    assert manager.reset_prefix_cache() == (True, "")
    assert manager.block_pool.retained_blocks("") == 0
    manager.check_invariants()


def test_a_retention_range_is_checked() -> None:
    with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
        Retention(12, 0)
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 0"):
        Retention(-1, 5)


def test_a_hybrid_layout_retains_what_a_hit_at_the_range_end_reads() -> None:
    """Full-attention group: every block of the range; each sliding group: the window's blocks
    before the range's end (a hit there reads no earlier one). The hit survives a flood."""
    from kvmemo.kv.hybrid import HybridKVCacheManager
    from kvmemo.kv.layout import KVGroup
    from tests.kv.kv_testing import make_layout

    layout = make_layout(40, 4)
    groups = (KVGroup("full", (2,)), KVGroup("sliding.0", (0,), 6), KVGroup("sliding.1", (1,), 6))
    fields = {f: getattr(layout, f) for f in layout.__slots__}
    manager = HybridKVCacheManager(type(layout)(**{**fields, "groups": groups}))
    manager.max_retained_blocks = 5
    prompt = list(range(1, 21))  # five full blocks
    _serve(manager, _asking(prompt, 60, "a", num_tokens=20))  # type: ignore[arg-type]
    pool = manager.block_pool
    retained = [b for b in pool.blocks if b.retained_until]
    assert sorted(b.group for b in retained) == [0] * 5 + [1] * 3 + [2] * 3
    assert pool.retained_blocks("") == 5  # the quota counts the full group's blocks
    for i in range(40):
        tokens = [100 + 10 * i + j for j in range(8)]
        _serve(manager, make_request(f"flood{i}", tokens))  # type: ignore[arg-type]
    assert _serve(manager, _asking(prompt + [99], None, "again")) == 20  # type: ignore[arg-type]
