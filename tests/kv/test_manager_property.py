"""Property test: random request lifecycles against a simulated device and a reference model.

The simulated device stores in every KV slot the identity of the KV it holds: (salt, the token
prefix up to that position), full and partially filled blocks alike. Any hit, copy (from a partial
or a committed full block) or adoption that would serve wrong KV shows up as a slot whose identity
differs from the request's own; ref counts are modelled exactly, and so is the free order under
LRU. Every eviction policy runs the machine (eviction.py), under the pool's invariant checker
after every step.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvmemo.kv.eviction import EVICTION_POLICIES
from kvmemo.kv.manager import BlockCopy, KVCacheManager, PrefixMatch
from kvmemo.request import Request
from tests.kv.kv_testing import make_manager, make_request

BLOCK_SIZE = 4
MAX_TOKENS = 28
Identity = tuple[object, tuple[int, ...]]
# Shared prompt heads, so that prefixes collide often; tails use a two-token vocabulary.
BASES = [[1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 1, 1], [0] * 16, [1, 1, 0, 1] * 4]


class KVCacheMachine(RuleBasedStateMachine):
    manager: KVCacheManager

    @initialize(
        num_blocks=st.integers(8, 24),
        enable_partial_reuse=st.booleans(),
        policy=st.sampled_from(EVICTION_POLICIES),
    )
    def setup(self, num_blocks: int, enable_partial_reuse: bool, policy: str) -> None:
        event(f"policy {policy}")
        self.manager = make_manager(
            num_blocks, BLOCK_SIZE, policy, enable_partial_reuse=enable_partial_reuse,
            enable_events=True,
        )
        self.device: dict[int, list[Identity | None]] = {
            i: [None] * BLOCK_SIZE for i in range(num_blocks)
        }
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.pending: dict[str, int] = {}  # scheduled this step, KV not computed yet
        self.copies: list[BlockCopy] = []  # recorded this step, run before its writes
        self.history: list[tuple[list[int], str | None]] = []  # released requests: tokens, salt
        self.num_requests = 0

    # ---- helpers ---------------------------------------------------------------------------

    @property
    def pool(self):  # type: ignore[no-untyped-def]
        return self.manager.block_pool

    def identity(self, request: Request, position: int) -> Identity:
        return (request.cache_salt, tuple(request.all_token_ids[: position + 1]))

    def slot(self, request: Request, position: int) -> Identity | None:
        block_id = self.manager.get_block_table(request.request_id)[position // BLOCK_SIZE]
        return self.device[block_id][position % BLOCK_SIZE]

    def check_match(self, request: Request, prefix: PrefixMatch) -> None:
        """Reference model: every hit slot holds exactly this request's KV."""
        for index, block in enumerate(prefix.blocks):
            for j in range(BLOCK_SIZE):
                expected = self.identity(request, index * BLOCK_SIZE + j)
                assert self.device[block.block_id][j] == expected
        if prefix.partial is not None:
            start = len(prefix.blocks) * BLOCK_SIZE
            for j in range(prefix.partial.num_tokens):
                expected = self.identity(request, start + j)
                assert self.device[prefix.partial.block.block_id][j] == expected
        assert prefix.num_tokens < request.num_tokens  # the last token is never a hit

    def release(self, request: Request) -> None:
        """free(), checking that the blocks reaching ref_count 0 become free: under LRU, at the
        tail, last first."""
        table = self.manager.get_block_table(request.request_id)
        before = self.pool.free_block_ids()
        released = [b for b in reversed(table) if self.pool.blocks[b].ref_count == 1]
        self.manager.free(request)
        self.running.remove(request)
        self.history.append((list(request.all_token_ids), request.cache_salt))
        if self.pool.eviction_policy == "lru":
            assert self.pool.free_block_ids() == before + released
        else:
            assert sorted(self.pool.free_block_ids()) == sorted(before + released)

    def idle_running(self) -> list[Request]:
        return [r for r in self.running if r.request_id not in self.pending]

    # ---- rules -----------------------------------------------------------------------------

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 16),
        tail=st.lists(st.integers(0, 1), max_size=6),
        salt=st.sampled_from([None, "tenant"]),
    )
    def new_request(self, base: list[int], cut: int, tail: list[int], salt: str | None) -> None:
        self.add_request(base[:cut] + tail or [0], salt)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), max_size=3))
    def clone_running(self, data: st.DataObject, tail: list[int]) -> None:
        """A request sharing a running one's tokens so far (prompt and generated)."""
        source = data.draw(st.sampled_from(self.running))
        cut = data.draw(st.integers(1, source.num_tokens))
        self.add_request(source.all_token_ids[:cut] + tail, source.cache_salt)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), max_size=5))
    def follow_up(self, data: st.DataObject, tail: list[int]) -> None:
        """The next turn of a released request: its tokens, cut anywhere, plus new ones (it
        diverges mid-block from committed full blocks, often free ones)."""
        tokens, salt = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(1, len(tokens)))
        self.add_request(tokens[:cut] + tail, salt)

    @precondition(lambda self: self.history or self.running)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), max_size=3))
    def probe(self, data: st.DataObject, tail: list[int]) -> None:
        """A read-only match of some seen tokens, cut anywhere: checks the sources it picks."""
        seen = self.history + [(r.all_token_ids, r.cache_salt) for r in self.running]
        tokens, salt = data.draw(st.sampled_from(seen))
        cut = data.draw(st.integers(1, len(tokens)))
        salt = data.draw(st.sampled_from([salt, None, "tenant"]))
        request = make_request("probe", tokens[:cut] + tail, cache_salt=salt)
        self.check_match(request, self.manager.get_computed_blocks(request))

    def add_request(self, tokens: list[int], salt: str | None) -> None:
        self.num_requests += 1
        self.waiting.append(make_request(f"r{self.num_requests}", tokens, cache_salt=salt))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.waiting))
        prefix = self.manager.get_computed_blocks(request)
        self.check_match(request, prefix)
        num_new = data.draw(st.integers(1, request.num_tokens - prefix.num_tokens))
        free_before = self.pool.free_block_ids()
        refs_before = [b.ref_count for b in self.pool.blocks]
        new_ids = self.manager.allocate_slots(request, num_new, prefix)
        if new_ids is None:  # nothing changed
            assert self.pool.free_block_ids() == free_before
            assert [b.ref_count for b in self.pool.blocks] == refs_before
            assert self.manager.get_block_table(request.request_id) == []
            return
        taken = {b.block_id for b in prefix.blocks}
        adopted: list[int] = []
        kept: list[int] = []  # a free full source: left out of the pops, back at the tail
        partial = prefix.partial
        if partial is not None and partial.block.block_id in free_before:
            source_id = partial.block.block_id
            num_free_hits = sum(b.block_id in free_before for b in prefix.blocks)
            exact_fit = len(new_ids) + num_free_hits == len(free_before)
            if partial.source_hash is None or exact_fit:
                adopted = [source_id]
            else:
                kept = [source_id]
            taken.add(source_id)
        if partial is not None:
            event(
                f"partial from a {'full' if partial.source_hash else 'partial'} block, "
                f"{'adopted' if adopted else 'kept free' if kept else 'referenced'}"
            )
        rest = [b for b in free_before if b not in taken]
        num_fresh = len(new_ids) - len(adopted)
        assert new_ids == adopted + rest[:num_fresh]  # fresh blocks come from the LRU head
        assert self.pool.free_block_ids() == rest[num_fresh:] + kept
        copies = self.manager.take_copies()
        if partial is not None and not adopted:
            source_id = partial.block.block_id
            assert copies == [BlockCopy(source_id, new_ids[0], partial.num_tokens)]
            assert new_ids[0] != source_id
            if partial.source_hash is not None:  # a full source stays a cached full block
                assert self.pool.get_cached_block(partial.source_hash) is partial.block
        else:
            assert copies == []
        self.copies.extend(copies)
        request.num_computed_tokens = prefix.num_tokens
        self.waiting.remove(request)
        self.running.append(request)
        self.pending[request.request_id] = num_new

    @precondition(lambda self: self.idle_running())
    @rule(data=st.data())
    def schedule_running(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.idle_running()))
        num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens))
        free_before = self.pool.free_block_ids()
        new_ids = self.manager.allocate_slots(request, num_new)
        if new_ids is None:
            assert self.pool.free_block_ids() == free_before
            self.preempt_request(request)
            return
        assert new_ids == free_before[: len(new_ids)]
        self.pending[request.request_id] = num_new

    @precondition(lambda self: self.pending)
    @rule(sampled=st.lists(st.integers(0, 1), min_size=8, max_size=8))
    def step(self, sampled: list[int]) -> None:
        assert self.manager.take_copies() == []  # admit() moved them to self.copies
        for copy in self.copies:  # in order, before the forward
            src, dst = self.device[copy.src_block_id], self.device[copy.dst_block_id]
            dst[: copy.num_tokens] = src[: copy.num_tokens]
        self.copies.clear()
        scheduled = [r for r in self.running if r.request_id in self.pending]
        for request in scheduled:
            for position in range(request.num_computed_tokens):
                assert self.slot(request, position) == self.identity(request, position)
        for index, request in enumerate(scheduled):
            table = self.manager.get_block_table(request.request_id)
            start = request.num_computed_tokens
            for position in range(start, start + self.pending.pop(request.request_id)):
                block = self.pool.blocks[table[position // BLOCK_SIZE]]
                assert block.ref_count == 1 and block.block_hash is None  # private while written
                slots = self.device[block.block_id]
                slots[position % BLOCK_SIZE] = self.identity(request, position)
            request.num_computed_tokens = position + 1
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token(sampled[index % len(sampled)])
            self.manager.commit(request, request.num_computed_tokens)
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
        if roll:  # rarely: a reset wipes the cache the other rules build up
            return
        ok, _ = self.manager.reset_prefix_cache()
        assert ok == (not self.running)
        if ok:
            for request in self.waiting:
                assert self.manager.get_computed_blocks(request).num_tokens == 0

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        holders = [0] * self.manager.num_blocks
        for request in self.running:
            for block_id in self.manager.get_block_table(request.request_id):
                holders[block_id] += 1
        assert [b.ref_count for b in self.pool.blocks] == holders

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.pending.clear()
        self.copies.clear()
        self.manager.take_copies()
        for request in list(self.running):
            self.release(request)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == self.manager.num_blocks


KVCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_manager_state_machine = KVCacheMachine.TestCase
