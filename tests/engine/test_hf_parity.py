"""Greedy tokens and last-position logits of kvmemo equal HF transformers on the same GGUF."""

from __future__ import annotations

import pytest
import torch

from kvmemo import SamplingParams
from kvmemo.model.layers.linear import KernelChoice, kernel_usable
from kvmemo.model.models.llama_fast import prepare
from tests.engine.prompts import CHAT_PROMPTS, RAW_PROMPTS
from tests.helpers import assert_all_blocks_free

pytestmark = pytest.mark.model

NUM_NEW_TOKENS = 32
LOGITS_ATOL = 2e-3


def hf_greedy(hf_model, prompt_ids: list[int], num_new: int) -> list[int]:
    """Plain greedy decoding with HF's own KV cache; never stops early (EOS is just a token)."""
    ids = torch.tensor([prompt_ids])
    out_tokens: list[int] = []
    past = None
    with torch.inference_mode():
        for _ in range(num_new):
            out = hf_model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            out_tokens.append(token)
            ids = torch.tensor([[token]])
    return out_tokens


@pytest.fixture(scope="module")
def prompt_token_ids(llm) -> list[list[int]]:
    processor = llm.engine.processor
    ids = [processor.encode_prompt(p) for p in RAW_PROMPTS]
    ids += [processor.encode_chat(c)[1] for c in CHAT_PROMPTS]
    assert len(ids) >= 8
    return ids


@pytest.fixture(scope="module")
def hf_tokens(hf_model, prompt_token_ids) -> list[list[int]]:
    return [hf_greedy(hf_model, ids, NUM_NEW_TOKENS) for ids in prompt_token_ids]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def test_greedy_matches_hf_one_at_a_time(llm, prompt_token_ids, hf_tokens):
    llm.reset_prefix_cache()
    for ids, expected in zip(prompt_token_ids, hf_tokens):
        out = llm.generate([ids], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected
    assert_all_blocks_free(llm)


def test_greedy_matches_hf_in_one_batch(llm, prompt_token_ids, hf_tokens):
    llm.reset_prefix_cache()
    outs = llm.generate(prompt_token_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "choice",
    [KernelChoice("torch", "torch"), KernelChoice("onednn", "onednn"),
     KernelChoice("skinny", "onednn"), KernelChoice("skinny", "torch")],
    ids=lambda c: f"decode-{c.decode}-prefill-{c.prefill}",
)
def test_greedy_matches_hf_in_every_kernel_choice(llm, prompt_token_ids, hf_tokens, choice):
    """The probe may pick any of these on some machine: each must give HF's tokens."""
    model = llm.engine.loaded.model
    for name in {choice.decode, choice.prefill}:
        if not kernel_usable(name, torch.float32, torch.device("cpu")):
            pytest.skip(f"kernel {name} is not available here")
    probed = model.linear_choice
    prepare(model, choice)
    try:
        assert model.layers[0].qkv.choice == choice  # bound as forced, nothing fell back
        llm.reset_prefix_cache()
        outs = llm.generate(prompt_token_ids, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    finally:
        prepare(model, probed)
    assert_all_blocks_free(llm)


def test_last_position_logits_match_hf(llm, hf_model, prompt_token_ids):
    engine = llm.engine
    worst = 0.0
    for ids in prompt_token_ids:
        with torch.inference_mode():
            expected = hf_model(input_ids=torch.tensor([ids])).logits[0, -1]
        engine.runner.capture_logits = True
        try:
            llm.reset_prefix_cache()
            llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            got = engine.runner.last_logits[0]
        finally:
            engine.runner.capture_logits = False
        worst = max(worst, float((got - expected).abs().max()))
    print(f"max |logits - HF logits| over {len(prompt_token_ids)} prompts: {worst:.2e}")
    assert worst < LOGITS_ATOL, f"max abs logits difference {worst:.2e} exceeds {LOGITS_ATOL}"
