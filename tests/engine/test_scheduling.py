"""Chunked prefill and preemption change how work is split, never the tokens produced."""

from __future__ import annotations

import pytest

from kvmemo import LLM, SamplingParams
from tests.engine.prompts import RAW_PROMPTS
from tests.helpers import assert_all_blocks_free

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LONG_PROMPT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(40))


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    prompts = RAW_PROMPTS + [LONG_PROMPT]
    llm.reset_prefix_cache()
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_chunked_prefill_with_tiny_budget_gives_identical_tokens(reference):
    small = LLM(num_blocks=256, max_num_batched_tokens=32, enable_prefix_caching=False)
    outs = small.generate(RAW_PROMPTS + [LONG_PROMPT], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_all_blocks_free(small)


def test_cache_too_small_for_all_requests_preempts_and_still_matches(reference):
    # LONG_PROMPT + 24 tokens needs ~28 blocks of 16; 30 blocks cannot hold all 7 requests.
    tight = LLM(num_blocks=30, enable_prefix_caching=False)
    outs = tight.generate(RAW_PROMPTS + [LONG_PROMPT], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert tight.get_metrics().num_preemptions > 0, "the cache was meant to force preemption"
    assert_all_blocks_free(tight)


def test_request_that_can_never_fit_is_rejected_at_admission():
    tiny = LLM(num_blocks=4)
    with pytest.raises(ValueError, match="KV cache holds only 4 blocks"):
        tiny.generate(LONG_PROMPT, GREEDY, use_tqdm=False)
    assert_all_blocks_free(tiny)
