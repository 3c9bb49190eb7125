"""Prefix caching changes how much is computed, never the tokens: on vs off, story by story."""

from __future__ import annotations

import pytest

from kvmemo import LLM, SamplingParams
from kvmemo.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmemo.kv.eviction import EVICTION_POLICIES
from tests.helpers import assert_all_blocks_free

pytestmark = pytest.mark.model

SYSTEM = (
    "You are the assistant of a hardware store. Opening hours: weekdays 8 to 18, Saturday 9 to 14. "
    "We sell tools, paint, garden supplies, screws, nails, timber cut to size, and we rent out "
    "ladders, drills and floor sanders by the day. Delivery within 10 km is free above 50 euros. "
    "Returns are accepted within 30 days with a receipt. Answer in one short sentence."
)
QUESTIONS = [
    "When do you open on Saturday?", "Do you rent drills?", "Is delivery free?", "Can I return paint?",
    "Do you cut timber?", "Do you sell screws?", "Are you open on Sunday?", "Can I rent a ladder?",
    "How far do you deliver?", "Do you sell garden hoses?", "What is the return window?", "Do you sell nails?",
    "Can I rent a floor sander?", "When do you close on weekdays?", "Do I need a receipt?", "Do you sell paint?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def conversations():
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="module")
def cold():
    return LLM(num_blocks=512, enable_prefix_caching=False)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_sixteen_requests_sharing_a_system_prompt(llm, cold):
    llm.reset_prefix_cache()
    warm = llm.chat(conversations(), GREEDY, use_tqdm=False)
    assert tokens(warm) == tokens(cold.chat(conversations(), GREEDY, use_tqdm=False))
    # The first request computes the system prompt; later ones hit its blocks.
    assert sum(o.metrics.num_cached_tokens for o in warm) > 10 * 16
    assert llm.get_metrics().prefix_cache_hits_tokens > 0


def test_four_turn_conversation_reuses_earlier_answers(llm, cold):
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=24)
    histories = {"warm": [{"role": "system", "content": SYSTEM}], "cold": [{"role": "system", "content": SYSTEM}]}
    prompt_lens: list[int] = []
    for turn, question in enumerate(QUESTIONS[:4]):
        answers = {}
        for name, engine in (("warm", llm), ("cold", cold)):
            histories[name].append({"role": "user", "content": question})
            out = engine.chat(histories[name], params, use_tqdm=False)[0]
            answers[name] = out
            histories[name].append({"role": "assistant", "content": out.outputs[0].text})
        assert answers["warm"].outputs[0].token_ids == answers["cold"].outputs[0].token_ids
        if turn > 0:
            # Everything up to the previous answer was computed before (prompt and generated).
            assert answers["warm"].metrics.num_cached_tokens >= prompt_lens[-1]
        prompt_lens.append(answers["warm"].metrics.num_prompt_tokens)


def _run_staggered(engine_llm, prompts_ids, params, steps_between):
    """Submit prompts one by one with decode steps in between; return outputs by request id."""
    engine = engine_llm.engine
    finished = {}
    for i, ids in enumerate(prompts_ids):
        engine.add_request(f"s{i}", engine.processor.process(ids), params)
        for _ in range(steps_between):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[f"s{i}"] for i in range(len(prompts_ids))]


def test_requests_arriving_mid_decode(llm, cold):
    llm.reset_prefix_cache()
    ids = [llm.engine.processor.encode_chat(c)[1] for c in conversations()[:6]]
    warm = _run_staggered(llm, ids, GREEDY, steps_between=3)
    ref = _run_staggered(cold, ids, GREEDY, steps_between=3)
    assert tokens(warm) == tokens(ref)
    assert all(o.metrics.num_cached_tokens > 0 for o in warm[1:])


def _one_at_a_time(llm: LLM) -> list:
    """Eight chats in turn (the odd ones a single message): in a small pool each evicts older
    blocks."""
    outs = []
    for i, conversation in enumerate(conversations()[:8]):
        outs += llm.chat([conversation[1]] if i % 2 else conversation, GREEDY, use_tqdm=False)
    return outs


@pytest.fixture(scope="module")
def uncached_one_at_a_time(cold) -> list:
    return tokens(_one_at_a_time(cold))


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_small_cache_forces_evictions_and_output_stays_identical(uncached_one_at_a_time, policy):
    small = LLM(num_blocks=14, eviction_policy=policy)
    assert tokens(_one_at_a_time(small)) == uncached_one_at_a_time
    assert small.get_metrics().prefix_cache_evicted_blocks > 0
    assert_all_blocks_free(small)


def test_chunked_prefill_over_a_cached_prefix(cold):
    chunked = LLM(num_blocks=256, max_num_batched_tokens=32)
    first = chunked.chat(conversations()[0], GREEDY, use_tqdm=False)[0]
    second = chunked.chat(conversations()[1], GREEDY, use_tqdm=False)[0]
    assert second.metrics.num_cached_tokens > 32  # more than one chunk's worth came from cache
    ref = cold.chat(conversations()[:2], GREEDY, use_tqdm=False)
    assert tokens([first, second]) == tokens(ref)
    assert_all_blocks_free(chunked)


def test_generated_blocks_are_reusable_while_the_request_still_runs(llm, cold):
    llm.reset_prefix_cache()
    engine = llm.engine
    block_size = engine.config.block_size
    prompt = engine.processor.encode_prompt("Write a long story about a lighthouse keeper and his cat.")
    params_a = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    engine.add_request("A", engine.processor.process(prompt), params_a)
    request_a = engine.scheduler.requests["A"]
    # Decode until A's generated tokens fill the block holding the prompt's end plus two more.
    target = (len(prompt) // block_size + 3) * block_size
    while request_a.num_computed_tokens < target:
        engine.step()
    assert not request_a.is_finished
    b_ids = request_a.all_token_ids[:target]
    engine.add_request("B", engine.processor.process(b_ids), GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    b = outs["B"]
    assert b.metrics.num_cached_tokens > len(prompt), (b.metrics.num_cached_tokens, len(prompt))
    assert b.metrics.num_cached_tokens >= target - block_size
    assert b.outputs[0].token_ids == cold.generate([b_ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_requests_share_a_prompt_computed_in_their_own_step(llm, cold):
    llm.reset_prefix_cache()
    engine = llm.engine
    system = engine.processor.encode_prompt(SYSTEM)
    prompts = [system + engine.processor.encode_prompt(" " + q) for q in QUESTIONS[:4]]
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", engine.processor.process(ids), GREEDY)
    first = engine.step()
    # One step gave every request its first token: the last three read the system prompt's
    # blocks that the first one's forward wrote in that same step.
    assert sorted(out.request_id for out in first) == ["r0", "r1", "r2", "r3"]
    num_shared = len(system) // engine.config.block_size * engine.config.block_size
    assert [o.metrics.num_cached_tokens for o in sorted(first, key=lambda o: o.request_id)] == [
        0, num_shared, num_shared, num_shared
    ]
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    expected = cold.generate(prompts, GREEDY, use_tqdm=False)
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(4)] == tokens(expected)


def test_partial_block_is_reused_by_copy(llm, cold):
    llm.reset_prefix_cache()
    block_size = llm.engine.config.block_size
    base = llm.engine.processor.encode_prompt(SYSTEM)
    cut = 2 * block_size + block_size // 2  # the middle of the third block
    a_ids = base[: cut + 4]
    llm.generate([a_ids], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    b_ids = base[:cut] + llm.engine.processor.encode_prompt(" Totally different ending here.")
    b = llm.generate([b_ids], GREEDY, use_tqdm=False)[0]
    assert b.metrics.num_cached_tokens == cut  # two full blocks + half a block copied
    assert llm.get_metrics().prefix_cache_partial_hit_tokens >= block_size // 2
    assert b.outputs[0].token_ids == cold.generate([b_ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_cache_salt_isolates_tenants(llm):
    llm.reset_prefix_cache()
    conversation = conversations()[0]
    llm.chat(conversation, GREEDY, use_tqdm=False, cache_salt="tenant-a")
    other = llm.chat(conversation, GREEDY, use_tqdm=False, cache_salt="tenant-b")[0]
    same = llm.chat(conversation, GREEDY, use_tqdm=False, cache_salt="tenant-a")[0]
    unsalted = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    assert other.metrics.num_cached_tokens == 0
    assert unsalted.metrics.num_cached_tokens == 0
    assert same.metrics.num_cached_tokens > 0
    assert other.outputs[0].token_ids == same.outputs[0].token_ids


def test_kv_events_reach_subscribers_in_order():
    events = []
    engine_llm = LLM(num_blocks=12, enable_kv_events=True)
    engine_llm.subscribe_kv_events(events.extend)
    engine_llm.chat(conversations()[0], GREEDY, use_tqdm=False)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored, "no BlockStored event"
    chain = [h for e in stored for h in e.block_hashes]
    assert stored[0].parent_block_hash == engine_llm.engine.hasher.root
    for earlier, later in zip(stored, stored[1:]):
        assert later.parent_block_hash == earlier.block_hashes[-1]  # one chain, in order
    engine_llm.chat(conversations()[1][1:], GREEDY, use_tqdm=False)  # unrelated: forces evictions
    engine_llm.chat([{"role": "user", "content": "Something else entirely, and long enough to evict. " * 8}], GREEDY, use_tqdm=False)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(chain) | {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    ok, reason = engine_llm.reset_prefix_cache()
    assert ok, reason
    assert isinstance(events[-1], AllBlocksCleared)
    quiet = LLM(num_blocks=20)
    with pytest.raises(ValueError, match="enable_kv_events=True"):
        quiet.subscribe_kv_events(events.extend)
