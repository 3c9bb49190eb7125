"""Property test: a hybrid layout (one full-attention group, two sliding-window groups sharing
one pool) against a simulated device.

Each group's pages are simulated separately: every slot holds the identity of the KV it stores,
(salt, token prefix up to that position). Whatever a hit, copy or window release does, every
slot a step's queries can see in every group must hold the request's own identity; a sliding
group must hold no block its window no longer needs; ref counts are checked over all groups.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmemo.kv.eviction import EVICTION_POLICIES
from kvmemo.kv.hybrid import HybridKVCacheManager
from kvmemo.kv.layout import KVGroup
from kvmemo.kv.match import PrefixMatch
from kvmemo.request import Request
from tests.kv.kv_testing import make_layout, make_request

BLOCK_SIZE = 4
WINDOW = 6  # tokens: a query sees itself and the 5 before it
MAX_TOKENS = 30
GROUPS = (
    KVGroup("full", (2,)),
    KVGroup("sliding.0", (0,), WINDOW),
    KVGroup("sliding.1", (1,), WINDOW),
)
BASES = [[1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1], [0] * 18, [1, 1, 0, 1] * 5]
Identity = tuple[object, tuple[int, ...]]


def first_visible(position: int) -> int:
    """The first position a query at `position` sees in a sliding group."""
    return max(0, position - WINDOW + 1)


class HybridMachine(RuleBasedStateMachine):
    manager: HybridKVCacheManager

    @initialize(
        num_blocks=st.integers(12, 40),
        enable_partial_reuse=st.booleans(),
        policy=st.sampled_from(EVICTION_POLICIES),
    )
    def setup(self, num_blocks: int, enable_partial_reuse: bool, policy: str) -> None:
        layout = make_layout(num_blocks, BLOCK_SIZE)
        layout = type(layout)(**{**{f: getattr(layout, f) for f in layout.__slots__}, "groups": GROUPS})
        self.manager = HybridKVCacheManager(
            layout, enable_partial_reuse=enable_partial_reuse, enable_events=True,
            eviction_policy=policy,
        )
        # One simulated page per (group, block id): a block may change groups when reused.
        self.device: dict[tuple[int, int], list[Identity | None]] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.pending: dict[str, int] = {}
        self.history: list[tuple[list[int], str | None]] = []
        self.num_requests = 0

    def identity(self, request: Request, position: int) -> Identity:
        return (request.cache_salt, tuple(request.all_token_ids[: position + 1]))

    def page(self, group: int, block_id: int) -> list[Identity | None]:
        return self.device.setdefault((group, block_id), [None] * BLOCK_SIZE)

    def check_match(self, request: Request, prefix: PrefixMatch) -> None:
        """Every group's hit slots that a query at prefix.num_tokens can see hold this
        request's KV; sliding groups hold a block for each of them."""
        assert prefix.num_tokens < request.num_tokens
        if prefix.num_tokens == 0:
            return
        assert len(prefix.group_matches) == len(GROUPS)
        for g, match in enumerate(prefix.group_matches):
            assert match.num_tokens == prefix.num_tokens
            start = 0 if GROUPS[g].sliding_window is None else first_visible(prefix.num_tokens)
            for position in range(start, len(match.blocks) * BLOCK_SIZE):
                block = match.blocks[position // BLOCK_SIZE]
                assert block is not None, f"group {g} misses block of position {position}"
                expected = self.identity(request, position)
                assert self.page(g, block.block_id)[position % BLOCK_SIZE] == expected
            if match.partial is not None:
                base = len(match.blocks) * BLOCK_SIZE
                for j in range(match.partial.num_tokens):
                    page = self.page(g, match.partial.block.block_id)
                    assert page[j] == self.identity(request, base + j)
            else:
                assert prefix.num_tokens % BLOCK_SIZE == 0

    def release(self, request: Request) -> None:
        self.manager.free(request)
        self.running.remove(request)
        self.history.append((list(request.all_token_ids), request.cache_salt))

    def idle_running(self) -> list[Request]:
        return [r for r in self.running if r.request_id not in self.pending]

    def add_request(self, tokens: list[int], salt: str | None) -> None:
        self.num_requests += 1
        self.waiting.append(make_request(f"r{self.num_requests}", tokens, cache_salt=salt))

    # ---- rules -----------------------------------------------------------------------------

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 18),
        tail=st.lists(st.integers(0, 1), max_size=6),
        salt=st.sampled_from([None, "tenant"]),
    )
    def new_request(self, base: list[int], cut: int, tail: list[int], salt: str | None) -> None:
        self.add_request(base[:cut] + tail or [0], salt)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), max_size=5))
    def follow_up(self, data: st.DataObject, tail: list[int]) -> None:
        tokens, salt = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(1, len(tokens)))
        self.add_request(tokens[:cut] + tail, salt)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), max_size=3))
    def clone_running(self, data: st.DataObject, tail: list[int]) -> None:
        source = data.draw(st.sampled_from(self.running))
        cut = data.draw(st.integers(1, source.num_tokens))
        self.add_request(source.all_token_ids[:cut] + tail, source.cache_salt)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.waiting))
        prefix = self.manager.get_computed_blocks(request)
        self.check_match(request, prefix)
        num_new = data.draw(st.integers(1, request.num_tokens - prefix.num_tokens))
        free_before = self.manager.num_free_blocks
        new_ids = self.manager.allocate_slots(request, num_new, prefix)
        if new_ids is None:  # all or nothing across groups
            assert self.manager.num_free_blocks == free_before
            assert all(t == [] for t in self.manager.get_group_block_tables(request.request_id))
            return
        for copy, in_group in self.take_copies():
            src, dst = self.page(in_group, copy[0]), self.page(in_group, copy[1])
            dst[: copy[2]] = src[: copy[2]]
        request.num_computed_tokens = prefix.num_tokens
        self.waiting.remove(request)
        self.running.append(request)
        self.pending[request.request_id] = num_new

    def take_copies(self) -> list[tuple[tuple[int, int, int], int]]:
        """This step's copies, each with the group whose page it copies."""
        out = []
        for g, group in enumerate(self.manager.groups):
            for c in group.take_copies():
                out.append(((c.src_block_id, c.dst_block_id, c.num_tokens), g))
        return out

    @precondition(lambda self: self.idle_running())
    @rule(data=st.data())
    def schedule_running(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.idle_running()))
        num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens))
        new_ids = self.manager.allocate_slots(request, num_new)
        if new_ids is None:
            self.preempt_request(request)
            return
        for copy, in_group in self.take_copies():  # copy-on-write never happens without forks
            raise AssertionError(f"unexpected copy {copy} in group {in_group}")
        self.pending[request.request_id] = num_new

    @precondition(lambda self: self.pending)
    @rule(sampled=st.lists(st.integers(0, 1), min_size=8, max_size=8))
    def step(self, sampled: list[int]) -> None:
        scheduled = [r for r in self.running if r.request_id in self.pending]
        for request in scheduled:
            tables = self.manager.get_group_block_tables(request.request_id)
            start = request.num_computed_tokens
            for g, table in enumerate(tables):
                sliding = GROUPS[g].sliding_window is not None
                first = first_visible(start) if sliding else 0
                for position in range(start):  # what this step's queries read
                    block_id = table[position // BLOCK_SIZE]
                    if position < first:
                        continue
                    assert block_id is not None, f"group {g}: position {position} released"
                    page = self.page(g, block_id)
                    assert page[position % BLOCK_SIZE] == self.identity(request, position)
                if sliding:  # nothing held that no query of it will see again
                    for index, block_id in enumerate(table):
                        if (index + 1) * BLOCK_SIZE <= first:
                            assert block_id is None, f"group {g} still holds block {index}"
        for index, request in enumerate(scheduled):
            tables = self.manager.get_group_block_tables(request.request_id)
            start = request.num_computed_tokens
            end = start + self.pending.pop(request.request_id)
            for g, table in enumerate(tables):
                for position in range(start, end):
                    block_id = table[position // BLOCK_SIZE]
                    assert block_id is not None
                    block = self.manager.block_pool.blocks[block_id]
                    assert block.ref_count == 1 and block.block_hash is None
                    self.page(g, block_id)[position % BLOCK_SIZE] = self.identity(request, position)
            request.num_computed_tokens = end
            if end == request.num_tokens:
                request.append_output_token(sampled[index % len(sampled)])
            self.manager.commit(request, end)
            if request.num_tokens >= MAX_TOKENS:
                self.release(request)

    @precondition(lambda self: self.idle_running())
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.release(data.draw(st.sampled_from(self.idle_running())))

    @precondition(lambda self: self.idle_running())
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.preempt_request(data.draw(st.sampled_from(self.idle_running())))

    def preempt_request(self, request: Request) -> None:
        self.release(request)
        request.num_computed_tokens = 0
        self.waiting.append(request)

    @rule(roll=st.integers(0, 3))
    def reset(self, roll: int) -> None:
        if roll:
            return
        ok, _ = self.manager.reset_prefix_cache()
        assert ok == (not self.running)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "manager"):
            self.manager.check_invariants()


HybridMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_hybrid_manager = HybridMachine.TestCase
