"""The pool's policies in keyed form, for store tiers: LRU against an independent reference, and
aged-arc's learned favour moving one victim and no other."""

from __future__ import annotations

import random
from collections import OrderedDict

from kvmemo.kv.keyed_eviction import KeyedAgedARC, KeyedLRU, make_keyed_eviction


def _reference_lru_victims(ops: list[tuple[str, int]]) -> list[int]:
    order: list[int] = []  # least recent first, kept as a plain list on purpose
    victims = []
    for op, key in ops:
        if op in ("insert", "touch"):
            if key in order:
                order.remove(key)
            order.append(key)
        elif op == "discard":
            if key in order:
                order.remove(key)
        else:
            victims.append(order.pop(0))
    return victims


def _random_ops(seed: int, n: int = 3000) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    present: OrderedDict[int, None] = OrderedDict()
    ops = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.45:
            key = rng.randrange(60)
            ops.append(("insert", key))
            present[key] = None
        elif roll < 0.7 and present:
            ops.append(("touch", rng.choice(list(present))))
        elif roll < 0.8 and present:
            key = rng.choice(list(present))
            ops.append(("discard", key))
            del present[key]
        elif len(present) > 0:
            ops.append(("pop", -1))
            present.popitem(last=False)  # only the count matters for the generator
    return ops


def _victims(policy, ops):
    victims = []
    for op, key in ops:
        if op == "pop":
            victims.append(policy.pop_victim())
        else:
            getattr(policy, op)(key)
    return victims


def test_keyed_lru_equals_a_reference_lru():
    for seed in range(5):
        ops = _random_ops(seed)
        assert _victims(KeyedLRU(), ops) == _reference_lru_victims(ops)


def test_aged_arc_without_ghost_hits_is_lru():
    """Favour starts at 1: until an evicted key comes back, aged-arc picks LRU's victims (ghosts
    too small to remember anything keep it there)."""
    for seed in range(5):
        ops = _random_ops(seed)
        assert _victims(KeyedAgedARC(ghost_keys=0), ops) == _reference_lru_victims(ops)


def test_a_read_key_evicted_too_early_raises_the_favour_of_read_keys():
    policy = KeyedAgedARC(ghost_keys=8)
    policy.insert("r")
    policy.touch("r")  # read: the read queue
    assert policy.pop_victim() == "r"  # remembered by the read queue's ghost
    policy.insert("r")  # back: favour 1.01, and "r" is a read key again
    assert policy.favour.value > 1.0 and "r" in policy.read
    policy.insert("f")  # one tick newer, never read
    policy.insert("x")
    for _ in range(110):  # ages: "f" 110+, "r" one more; 1.01 x age("f") >= age("r")
        policy.touch("x")
    assert policy.pop_victim() == "f"  # LRU would take "r"
    assert policy.pop_victim() == "r"


def test_a_fresh_key_evicted_too_early_lowers_the_favour_but_not_below_one():
    policy = KeyedAgedARC(ghost_keys=8)
    policy.insert("a")
    assert policy.pop_victim() == "a"
    policy.insert("a")  # B1 hit
    assert policy.favour.value == 1.0 and "a" in policy.read


def test_the_pool_policies_without_a_keyed_form_fall_back_to_lru():
    assert make_keyed_eviction("aged-arc", 100).name == "aged-arc"
    for name in ("lru", "arc", "s3fifo"):
        assert make_keyed_eviction(name, 100).name == "lru"
