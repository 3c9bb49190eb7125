"""Penalties, logit_bias and min_tokens: each checked against a reference computed here from the
logits, in a batch that mixes settings; seeded sampling gives the same tokens alone or in a
batch; greedy repetition_penalty equals HF transformers' on the real model."""

from __future__ import annotations

import pytest
import torch

from kvmemo import SamplingParams
from kvmemo.engine.sampler import Sampler

VOCAB = 40
EOS = 3


def reference(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]):
    """vLLM's definitions, one token at a time, in plain Python."""
    out = list(row)
    for t in range(VOCAB):
        if p.repetition_penalty != 1.0 and (t in prompt or t in output):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = output.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        out[t] += (p.logit_bias or {}).get(t, 0.0)
        for banned in p.bad_words_token_ids:
            head = list(banned[:-1])
            if t == banned[-1] and len(output) >= len(head) and (
                output[len(output) - len(head):] == head
            ):
                out[t] = float("-inf")
        if len(output) < p.min_tokens and (t == EOS or t in p.stop_token_ids):
            out[t] = float("-inf")
    return out


CASES = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.7),
    SamplingParams(temperature=0.0, repetition_penalty=0.6),
    SamplingParams(temperature=0.0, frequency_penalty=0.9, presence_penalty=-0.4),
    SamplingParams(temperature=0.0, logit_bias={7: 5.5, 11: -100.0, 39: 2.0}),
    SamplingParams(temperature=0.0, min_tokens=9, stop_token_ids=[5]),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                   logit_bias={EOS: 30.0}, min_tokens=4),
    # (5,) always banned; (1, 2): 2 banned after a 1; (8, 9, 10): 10 only after 8, 9
    SamplingParams(temperature=0.0, bad_words_token_ids=((5,), (1, 2), (8, 9, 10))),
]


def test_penalties_match_the_reference_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB) * 3
    histories = [
        (torch.randint(0, VOCAB, (12,)).tolist(), torch.randint(0, VOCAB, (n,)).tolist())
        for n in (0, 5, 6, 8, 3, 2, 3)
    ] + [([4, 4], [7, 8, 9, 1])]  # ends with 1 (bans 2), not with 8, 9 (10 stays)
    sampler = Sampler(0, "cpu", eos_token_ids=[EOS])
    got = sampler._penalized(logits, CASES, histories)
    for i, (p, (prompt, output)) in enumerate(zip(CASES, histories)):
        expected = torch.tensor(reference(logits[i].tolist(), p, prompt, output))
        torch.testing.assert_close(got[i], expected, rtol=1e-6, atol=1e-5)
    assert not torch.equal(got[1:], logits[1:])  # every case but the plain one changed its row
    torch.testing.assert_close(got[0], logits[0])
    tokens = sampler.sample(logits, CASES, [len(o) for _, o in histories], histories)
    assert [t.token_id for t in tokens] == got.argmax(dim=-1).tolist()
    assert tokens[5].token_id not in (EOS, 5) and tokens[6].token_id != EOS  # min_tokens
    banned = torch.isinf(got[7]).nonzero().flatten().tolist()
    assert banned == [2, 5]  # the reference agrees (above); here the plain statement of it


@pytest.mark.parametrize("penalty", [1e-300, 1e300])
def test_extreme_penalties_never_break_sampling(penalty):
    """Valid but absurd values must not produce NaN probabilities (one request would fail the
    whole step for its batch)."""
    logits = torch.randn(2, VOCAB) * 5
    seen = list(range(VOCAB))  # every token seen: every logit overflows or vanishes
    params = [SamplingParams(temperature=0.7, seed=1, repetition_penalty=penalty),
              SamplingParams(temperature=0.0, repetition_penalty=penalty, presence_penalty=2.0)]
    tokens = Sampler(0, "cpu").sample(logits, params, [VOCAB, VOCAB], [(seen, seen)] * 2)
    assert all(0 <= t.token_id < VOCAB for t in tokens)


def test_a_row_without_usable_probabilities_falls_back_to_its_argmax():
    logits = torch.randn(3, VOCAB)
    logits[1] = float("nan")
    logits[1, 9] = 5.0
    params = [SamplingParams(temperature=1.0, seed=3)] * 3
    tokens = Sampler(0, "cpu").sample(logits, params, [0, 0, 0])
    assert tokens[1].token_id == 9 and all(0 <= t.token_id < VOCAB for t in tokens)


def test_logprobs_stay_the_models_own():
    logits = torch.randn(1, VOCAB)
    p = SamplingParams(temperature=0.0, logit_bias={4: 50.0}, logprobs=2)
    token = Sampler(0, "cpu").sample(logits, [p], [0], [([1], [])])[0]
    assert token.token_id == 4
    assert token.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, 4]), abs=1e-6)


def test_seeded_penalized_sampling_is_the_same_alone_and_in_a_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    seeded = SamplingParams(temperature=0.8, seed=42, repetition_penalty=1.4, presence_penalty=0.7)
    others = [SamplingParams(temperature=1.0, frequency_penalty=1.0), SamplingParams(temperature=0.0)]
    history = ([1, 2, 3], [4, 4, 9])
    sampler = Sampler(7, "cpu")
    alone = sampler.sample(logits[1:2], [seeded], [3], [history])[0].token_id
    batch = sampler.sample(logits, [others[0], seeded, others[1]], [3, 3, 3],
                           [([5], [6, 6]), history, None])
    assert batch[1].token_id == alone


def test_bad_values_name_their_field(llm):
    for field, value in [("repetition_penalty", 0.0), ("presence_penalty", 2.5),
                         ("frequency_penalty", -3), ("min_tokens", 99), ("logit_bias", {"a": 1})]:
        with pytest.raises(ValueError, match=field) as info:
            SamplingParams(max_tokens=16, **{field: value})
        assert info.value.param == field
    with pytest.raises(ValueError, match="logit_bias token ids") as info:
        llm.generate("Hi", SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    assert info.value.param == "logit_bias"


@pytest.mark.model
def test_greedy_repetition_penalty_equals_hf(llm, hf_model):
    prompt = "List the days of the week: Monday, Tuesday,"
    ids = llm.engine.processor.encode_prompt(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.35, ignore_eos=True)
    got = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                                repetition_penalty=1.35, min_new_tokens=24)
    assert got == out[0, len(ids):].tolist()
    plain = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert plain != got  # the penalty changed the continuation


@pytest.mark.model
def test_min_tokens_holds_back_eos(llm):
    prompt = llm.engine.processor.process_chat([{"role": "user", "content": "Say OK."}])
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40),
                        use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 20
    held = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, min_tokens=20),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 20
    assert not set(held.token_ids[:19]) & set(llm.engine.eos_token_ids)


def test_random_draws_follow_the_distribution_and_skip_zero_mass():
    """The inverse-CDF draw: empirical frequencies match the probabilities, a token of zero
    probability never comes, and a seeded row is reproducible."""
    from kvmemo.engine.sampler import _inverse_cdf

    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(20000, 1)
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    drawn = _inverse_cdf(probs, uniforms)
    freq = torch.bincount(drawn, minlength=5).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0]), atol=0.015, rtol=0)
    assert _inverse_cdf(probs[:2], torch.tensor([0.0, 0.9999999])).tolist() == [0, 3]
    logits = torch.randn(1, VOCAB)
    p = SamplingParams(temperature=1.0, seed=11)
    first = Sampler(0, "cpu").sample(logits, [p], [4])[0].token_id
    assert Sampler(99, "cpu").sample(logits, [p], [4])[0].token_id == first


def test_bad_words_never_appear(llm):
    """The greedy continuation names a word; banned, it is gone (alone and after a space)."""
    prompt = "The capital of France is"
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0),
                         use_tqdm=False)[0].outputs[0].text
    assert "Paris" in plain
    banned = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                   bad_words=["Paris"]),
                          use_tqdm=False)[0].outputs[0].text
    assert "Paris" not in banned and banned != plain
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])
