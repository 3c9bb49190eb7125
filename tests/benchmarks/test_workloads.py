"""The benchmark workloads are deterministic and share exactly what they claim to share."""

from __future__ import annotations

import pytest

from benchmarks.workloads import WORKLOADS, Workload, build_workload, bundled_tokenizer

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tokenizer():
    return bundled_tokenizer()


def _token_ids(workload: Workload) -> list[list[int]]:
    if workload.requests:
        return [r["prompt_token_ids"] for r in workload.requests]
    return [c["system_token_ids"] + sum(c["user_segments"], []) for c in workload.conversations]


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_token_ids_other_seed_other_ids(tokenizer, name):
    first = build_workload(name, tokenizer, seed=0)
    again = build_workload(name, tokenizer, seed=0)
    other = build_workload(name, tokenizer, seed=1)
    assert _token_ids(first) == _token_ids(again)
    assert _token_ids(first) != _token_ids(other)
    assert Workload.from_json(first.to_json()) == first


def test_w1_shares_its_system_prompt_token_for_token_and_nothing_more(tokenizer):
    w1 = build_workload("W1", tokenizer)
    prompts = _token_ids(w1)
    assert len(prompts) == 32
    shared = w1.shared_prefix_tokens
    assert 1000 <= shared <= 1048  # ~1,024 tokens
    assert all(p[:shared] == prompts[0][:shared] for p in prompts)
    # The questions are distinct: no two prompts are equal, and each has ~32 tokens of its own.
    assert len({tuple(p) for p in prompts}) == len(prompts)
    assert all(32 <= len(p) - shared <= 64 for p in prompts)
    text = tokenizer.decode(prompts[0][:shared])
    assert text.startswith("<|im_start|>system") and text.rstrip().endswith("<|im_end|>")


def test_w0_prompts_have_exact_lengths_and_no_common_first_token(tokenizer):
    w0 = build_workload("W0", tokenizer)
    prompts = _token_ids(w0)
    assert [len(p) for p in prompts] == [1056] * 32
    assert len({p[0] for p in prompts}) == 32


def test_w2_turns_open_a_user_message_and_an_assistant_answer(tokenizer):
    w2 = build_workload("W2", tokenizer)
    assert len(w2.conversations) == 8
    for conversation in w2.conversations:
        assert len(conversation["user_segments"]) == 4
        for segment in conversation["user_segments"]:
            text = tokenizer.decode(segment)
            assert text.startswith("<|im_start|>user") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(w2.answer_end_token_ids) == "<|im_end|>\n"
    # Conversations never share their first block, so the only reuse is within a conversation.
    firsts = {tuple(c["system_token_ids"][:16]) for c in w2.conversations}
    assert len(firsts) == 8


def test_unknown_workload_and_bad_scale_are_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="workload must be one of"):
        build_workload("W9", tokenizer)
    with pytest.raises(ValueError, match="scale must be in"):
        build_workload("W1", tokenizer, scale=0)
