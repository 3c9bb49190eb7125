"""Prompt logprobs (what `echo` with `logprobs` and lm-eval's loglikelihood tasks read) equal HF
transformers' on the same GGUF within 1e-3: on a cold cache, with the prompt already cached
(a request that asks reads no cached KV), and computed in prefill chunks."""

from __future__ import annotations

import pytest
import torch

from kvmemo import LLM, SamplingParams
from tests.engine.prompts import RAW_PROMPTS

pytestmark = pytest.mark.model

ATOL = 1e-3


def hf_prompt_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: log p(. | ids[:p+1]) for p = 0 .. len - 2."""
    with torch.inference_mode():
        logits = hf_model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_hf(hf_model, out, top_k: int) -> None:
    ids = out.prompt_token_ids
    expected = hf_prompt_logprobs(hf_model, ids)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    for p, entry in enumerate(got[1:]):
        token = ids[p + 1]
        assert abs(entry[token] - float(expected[p, token])) < ATOL, (p, token)
        top_values, top_ids = torch.topk(expected[p], top_k)
        others = {t: v for t, v in entry.items() if t != token}
        # The top-k: each returned alternative's value matches, and they are HF's best (ties
        # within the tolerance may order differently).
        assert len(entry) in (top_k, top_k + 1)
        for t, v in others.items():
            assert abs(v - float(expected[p, t])) < ATOL
            assert float(expected[p, t]) >= float(top_values[-1]) - ATOL


def test_prompt_logprobs_match_hf_cold_and_cached(llm, hf_model):
    prompts = RAW_PROMPTS[:3]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    cold = llm.generate(prompts, params, use_tqdm=False)
    for out in cold:
        check_against_hf(hf_model, out, 3)
    # The same prompts again: their blocks are cached now, but a request asking for prompt
    # logprobs computes its prompt anyway, and says so.
    warm = llm.generate(prompts, params, use_tqdm=False)
    for out in warm:
        assert out.metrics.num_cached_tokens == 0
        check_against_hf(hf_model, out, 3)
    # Without the flag the same prompt hits the cache (the asking requests still shared theirs).
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.metrics.num_cached_tokens > 0 and plain.prompt_logprobs is None


def test_prompt_logprobs_in_prefill_chunks(hf_model):
    chunked = LLM(num_blocks=128, max_num_batched_tokens=32)
    prompt = " ".join(RAW_PROMPTS * 3)  # 144 tokens: five chunks
    out = chunked.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0),
                           use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 3 * 32
    check_against_hf(hf_model, out, 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_prompt_logprobs_range_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
