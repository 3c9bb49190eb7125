"""Seeded sampling is reproducible across runs and batch compositions; n, stop and logprobs work."""

from __future__ import annotations

import math

import pytest

from kvmemo import SamplingParams
from tests.helpers import assert_all_blocks_free

pytestmark = pytest.mark.model

PROMPT = "Tell me a story about a dragon."


def _tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_same_seed_same_output_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
    alone = llm.generate(PROMPT, seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(PROMPT, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20)
    batch = llm.generate(["Hello there", PROMPT, "Another prompt"], [others, seeded, others], use_tqdm=False)
    assert alone == again == batch[1].outputs[0].token_ids
    different = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=20), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone
    assert_all_blocks_free(llm)


def test_n_samples_and_min_p(llm):
    params = SamplingParams(n=3, temperature=1.0, min_p=0.05, seed=7, max_tokens=12)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "three seeded samples were all equal"


def test_stop_string_and_token_ids(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = llm.generate("Count: 1, 2, 3,", greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text.strip()[4:8]
    assert stop
    cut = llm.generate(
        "Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=40, stop=stop), use_tqdm=False
    )[0].outputs[0]
    assert stop not in cut.text and cut.finish_reason == "stop" and cut.stop_reason == stop
    assert full.text.startswith(cut.text)
    stop_id = full.token_ids[3]
    by_id = llm.generate(
        "Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert by_id.token_ids[-1] == stop_id and by_id.finish_reason == "stop"
    assert len(by_id.token_ids) <= 4


def test_logprobs_hold_the_sampled_token_and_top_k(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and len(entry) >= 3
        assert entry[token] == max(entry.values())  # greedy picks the most likely token
        assert all(v <= 0.0 and not math.isnan(v) for v in entry.values())


def test_outputs_carry_metrics(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert out.finished and out.metrics.ttft_s is not None and out.metrics.ttft_s > 0
    assert out.metrics.num_prompt_tokens == len(out.prompt_token_ids)
    assert 0 <= out.metrics.num_cached_tokens < out.metrics.num_prompt_tokens


def test_extreme_temperature_and_top_k_do_not_break_a_batch(llm):
    params = [
        SamplingParams(temperature=1e-40, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=2**70, seed=3, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    ]
    outs = llm.generate([PROMPT, PROMPT, PROMPT], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids  # tiny temperature = greedy
    assert len(outs[1].outputs[0].token_ids) == 4


def test_stop_string_inclusion_special_tokens_and_allowed_ids(llm):
    """vLLM's include_stop_str_in_output, skip_special_tokens and allowed_token_ids."""
    prompt = "The capital of France is"
    base = dict(max_tokens=12, temperature=0.0)
    plain = llm.generate([prompt], SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    assert "Paris" in plain.text
    cut = llm.generate([prompt], SamplingParams(**base, stop=["Paris"]), use_tqdm=False)
    kept = llm.generate([prompt], SamplingParams(**base, stop=["Paris"],
                                                 include_stop_str_in_output=True), use_tqdm=False)
    head = plain.text[: plain.text.index("Paris")]
    assert cut[0].outputs[0].text == head
    assert kept[0].outputs[0].text == head + "Paris"
    # A stop token id ends the output and leaves no text; included, its text stays.
    stop_id = plain.token_ids[2]
    stopped = llm.generate([prompt], SamplingParams(**base, stop_token_ids=[stop_id]),
                           use_tqdm=False)[0].outputs[0]
    tokenizer = llm.engine.tokenizer
    assert stopped.token_ids == plain.token_ids[:3]
    assert stopped.text == tokenizer.decode(plain.token_ids[:2])
    with_stop = llm.generate([prompt], SamplingParams(**base, stop_token_ids=[stop_id],
                                                      include_stop_str_in_output=True),
                             use_tqdm=False)[0].outputs[0]
    assert with_stop.text == tokenizer.decode(plain.token_ids[:3])
    # Special tokens in the middle of an output: kept as text only when asked.
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = dict(base, max_tokens=3, logit_bias={special: 100.0})
    hidden = llm.generate([prompt], SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    shown = llm.generate([prompt], SamplingParams(**forced, skip_special_tokens=False),
                         use_tqdm=False)[0].outputs[0]
    assert hidden.token_ids == [special] * 3 and hidden.text == ""
    assert shown.text == "<|im_start|>" * 3
    # allowed_token_ids: every token comes from the list, even sampled at temperature 2.
    allowed = plain.token_ids[:4]
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=2.0, seed=0,
                                                allowed_token_ids=allowed),
                       use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([prompt], SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)


def test_argmax_rows_is_torchs_argmax_on_ties_nan_and_inf() -> None:
    import torch

    from kvmemo.engine.sampler import argmax_rows

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen)
    logits[1, [7, 300, 999]] = 50.0  # a tie: the first
    logits[2, 400] = float("nan")  # NaN counts as the maximum
    logits[2, 500] = float("nan")
    logits[3] = float("-inf")  # nothing allowed: index 0
    logits[4, 10] = float("inf")
    logits[4, 20] = float("inf")
    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and got.tolist() == torch.argmax(logits, dim=-1).tolist()
    assert got.tolist()[1:4] == [7, 400, 0]
    sliced = logits[:, ::3]  # a strided view
    assert argmax_rows(sliced).tolist() == torch.argmax(sliced, dim=-1).tolist()
