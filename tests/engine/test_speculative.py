"""Speculative decoding (kvmemo/spec) is lossless: with drafts from the request itself (ngram)
or from what the engine saw (suffix), tokens and logprobs equal the plain run's bit for bit in
the default mode (native weights: every row's products and attention are its own, so k + 1
rows verified together give each row's plain bits), greedy and seeded, alone and batched,
cached and not, with stop rules, grammars and penalties; in the exact mode (dense fp32, whose
GEMM blocks rows together) the tokens are equal. Rejected draft tokens never reach a block
hash, a KV event or the store."""

from __future__ import annotations

import json

import pytest

from kvmemo import LLM, SamplingParams
from tests.helpers import assert_all_blocks_free

pytestmark = pytest.mark.model

CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
    "def volume(width, height, depth):\n    return width * height * depth\n"
)
COPY = [{"role": "user", "content": f"Repeat this code exactly:\n\n{CODE}"}]
EDIT = [{"role": "user", "content": f"Rename width to w in this code:\n\n{CODE}"}]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
LIST = "Count: one two three four, one two three four, one two three four, one two"


# The default mode's weights (the suite's conftest picks the exact mode for "auto").
DEFAULT = {"weights": "native"}


@pytest.fixture(scope="module")
def plain():
    return LLM(num_blocks=256, **DEFAULT)


@pytest.fixture(scope="module")
def ngram():
    return LLM(num_blocks=256, speculative_config={"method": "ngram", "num_speculative_tokens": 6},
               **DEFAULT)


def _run(llm, params, chats=(COPY, EDIT, CHAT), prompts=(LIST,)):
    outs = llm.chat(list(chats), params, use_tqdm=False) if chats else []
    outs += llm.generate(list(prompts), params, use_tqdm=False) if prompts else []
    return outs


def _tokens(outs):
    return [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]


def _accepted(outs):
    return sum(o.metrics.num_accepted_tokens for o in outs)


def test_greedy_equals_plain_alone_batched_and_cached(plain, ngram):
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=2)
    reference = [_tokens(_run(plain, params, chats=[c], prompts=())) for c in (COPY, EDIT, CHAT)]
    reference = [t for r in reference for t in r] + _tokens(_run(plain, params, chats=()))
    ngram.reset_prefix_cache()
    batched = _run(ngram, params)  # a mixed batch, nothing cached
    assert _tokens(batched) == reference
    assert _accepted(batched) > 20, "the drafts were never taken: the check has no power"
    assert all(o.metrics.num_draft_tokens >= o.metrics.num_accepted_tokens for o in batched)
    cached = _run(ngram, params)  # the prompts (and the replies' blocks) hit the cache now
    assert sum(o.metrics.num_cached_tokens for o in cached) > 0
    assert _tokens(cached) == reference
    for chat, expected in zip((COPY, EDIT, CHAT), reference):
        assert _tokens(_run(ngram, params, chats=[chat], prompts=())) == [expected]
    assert_all_blocks_free(ngram)


def test_exact_mode_greedy_tokens_equal_plain():
    """Dense fp32: the tokens are the plain run's (the last bits of logprobs may differ: the
    GEMM of k + 1 rows is not the GEMM of one)."""
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = LLM(num_blocks=128, weights="dense", dtype="float32")
    want = [c.token_ids for o in _run(plain, params) for c in o.outputs]
    del plain
    spec = LLM(num_blocks=128, weights="dense", dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 6})
    outs = _run(spec, params)
    assert [c.token_ids for o in outs for c in o.outputs] == want
    assert _accepted(outs) > 10


def test_seeded_sampling_equals_plain_with_penalties_and_n(plain, ngram):
    """Each draft row draws with its own (seed, step) uniform, as the plain step would: a
    seeded output is the plain one token for token, not just alike in distribution."""
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=11, logprobs=1, n=2,
                            repetition_penalty=1.05, min_tokens=5)
    expected = _tokens(_run(plain, params))
    outs = _run(ngram, params)
    assert _tokens(outs) == expected
    assert _accepted(outs) > 0


def test_stop_rules_inside_a_draft(plain, ngram):
    """A stop string or token reached inside a kept draft ends the output where the plain run
    ends it, and max_tokens is exact."""
    reference = _run(plain, SamplingParams(max_tokens=60, temperature=0.0), chats=[COPY],
                     prompts=())[0].outputs[0]
    words = reference.text.split()
    stop = words[len(words) // 2]
    token = reference.token_ids[20]
    for params in (
        SamplingParams(max_tokens=60, temperature=0.0, stop=[stop]),
        SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[token]),
        SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True),
    ):
        want = _run(plain, params, chats=[COPY], prompts=())[0].outputs[0]
        got = _run(ngram, params, chats=[COPY], prompts=())[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason
        )
    assert_all_blocks_free(ngram)


def test_structured_output_rolls_the_grammar_back(plain, ngram):
    schema = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    from kvmemo.structured.params import StructuredOutputsParams

    params = SamplingParams(max_tokens=60, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(json=schema))
    want = _run(plain, params, chats=[COPY], prompts=())[0].outputs[0]
    got = _run(ngram, params, chats=[COPY], prompts=())
    assert got[0].outputs[0].token_ids == want.token_ids
    assert _accepted(got) > 0


def test_preemption_under_a_small_pool(plain):
    """Drafts give way before any request does; a preempted request recomputes and still
    gives the plain tokens."""
    small = LLM(num_blocks=16, speculative_config={"method": "ngram"}, **DEFAULT)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = [f"({i}) " + LIST for i in range(8)]
    want = _tokens(plain.generate(prompts, params, use_tqdm=False))
    outs = small.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == want
    assert small.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(small)


def test_rejected_tokens_never_reach_a_hash_an_event_or_the_store(tmp_path, plain):
    llm = LLM(num_blocks=256, kv_store=f"disk:{tmp_path}", enable_kv_events=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8}, **DEFAULT)
    events = []
    llm.engine.subscribe_kv_events(events.extend)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    outs = _run(llm, params)
    llm.engine.flush_kv_store()
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert drafted > _accepted(outs) > 0, "no draft was rejected: the check has no power"
    # What may be stored: the blocks of each request's final tokens (prompt and output).
    from kvmemo.request import Request

    allowed = set()
    sequences = []
    for out in outs:
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        sequences.append(tokens)
        request = Request("check", tokens, params, hasher=llm.engine.hasher)
        allowed.update(bytes(h).hex() for h in request.block_hashes)
    stored = {p.name.removesuffix(".kvb") for p in tmp_path.rglob("*.kvb")}
    assert stored and stored <= allowed
    size = llm.engine.layout.block_size
    for event in events:
        if type(event).__name__ != "BlockStored":
            continue
        assert {bytes(h).hex() for h in event.block_hashes} <= allowed
        # Its tokens are a whole-block run of some request's final tokens.
        run = list(event.token_ids)
        assert any(
            seq[i : i + len(run)] == run for seq in sequences for i in range(0, len(seq), size)
        )


def test_suffix_drafts_from_what_the_engine_saw(plain):
    """A second request asking what an earlier one asked gets the earlier answer as drafts
    (same cache_salt); the output is still the plain one."""
    llm = LLM(num_blocks=256, speculative_config={"method": "suffix"}, **DEFAULT)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    want = _tokens(_run(plain, params, chats=[CHAT], prompts=()))
    first = llm.chat([CHAT], params, use_tqdm=False, cache_salt="tenant-a")
    again = llm.chat([CHAT], params, use_tqdm=False, cache_salt="tenant-a")
    other = llm.chat([CHAT], params, use_tqdm=False, cache_salt="tenant-b")
    assert _tokens(first) == _tokens(again) == _tokens(other) == want
    n = len(want[0][0])
    assert again[0].metrics.num_accepted_tokens >= n - 3  # the earlier answer, replayed
    assert other[0].metrics.num_accepted_tokens < again[0].metrics.num_accepted_tokens


def test_config_errors_name_the_problem():
    from kvmemo.spec.config import SpeculativeConfig

    for bad, words in (
        ({"method": "eagle"}, "method must be one of"),
        ({"method": "ngram", "num_speculative_token": 3}, "unknown speculative_config key"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "at most"),
        ("{not json", "not valid JSON"),
        ({"num_speculative_tokens": 3}, "needs a method"),
    ):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)
    parsed = SpeculativeConfig.parse(json.dumps({"method": "ngram", "prompt_lookup_max": 4}))
    assert (parsed.num_draft_tokens, parsed.lookup_min, parsed.lookup_max) == (5, 2, 4)


def test_gemma_sliding_layers(gemma3_gguf):
    """Gemma 3's hybrid layout (sliding-window layers release blocks behind the window): a
    prompt past the 512-token window, drafts verified across it, bits equal to the plain run."""
    model = str(gemma3_gguf)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    long_copy = [{"role": "user", "content": f"Repeat the last function:\n\n{CODE * 12}"}]
    plain = LLM(model, num_blocks=256, **DEFAULT)
    want = _tokens(_run(plain, params, chats=[long_copy, CHAT], prompts=()))
    assert _prompt_len(plain, long_copy) > 512
    del plain
    spec = LLM(model, num_blocks=256, speculative_config={"method": "ngram"}, **DEFAULT)
    outs = _run(spec, params, chats=[long_copy, CHAT], prompts=())
    assert _tokens(outs) == want
    assert _accepted(outs) > 10
    assert_all_blocks_free(spec)


def _prompt_len(llm, chat) -> int:
    return llm.chat([chat], SamplingParams(max_tokens=1), use_tqdm=False)[0].metrics.num_prompt_tokens


def test_a_restarted_engine_replays_from_the_saved_corpus(tmp_path, plain):
    """The suffix corpus is saved beside the disk KV store: a new engine on the same store
    replays an earlier greedy answer whole (one draft), and its output is the plain one."""
    spec = {"method": "suffix", "num_speculative_tokens": 8}
    params = SamplingParams(max_tokens=40, temperature=0.0)
    want = _tokens(_run(plain, params, chats=[CHAT], prompts=()))
    first = LLM(num_blocks=256, kv_store=f"disk:{tmp_path}", speculative_config=spec, **DEFAULT)
    assert _tokens(_run(first, params, chats=[CHAT], prompts=())) == want
    first.engine.flush_kv_store()
    del first
    again = LLM(num_blocks=256, kv_store=f"disk:{tmp_path}", speculative_config=spec, **DEFAULT)
    out = _run(again, params, chats=[CHAT], prompts=())
    assert _tokens(out) == want
    n = len(want[0][0])
    # One draft of the whole rest, not 8 at a time: every token after the prompt step's is
    # drafted and kept (but the last, sampled after the draft, when max_tokens ended it).
    whole = n - 1 if out[0].outputs[0].finish_reason == "stop" else n - 2
    assert out[0].metrics.num_drafts == 1 and out[0].metrics.num_accepted_tokens == whole
    assert out[0].metrics.num_cached_tokens > 0  # the prompt's KV came back from the store
