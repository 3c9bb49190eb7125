"""Beam search equals HF transformers `generate(num_beams=k, do_sample=False)` on the same GGUF,
runs every beam of every request in one forward per step, publishes only final beams' blocks,
survives preemption, and frees every block when it ends."""

from __future__ import annotations

import pytest
import torch

from kvmemo import LLM, SamplingParams
from kvmemo.engine import BeamSearchParams
from kvmemo.kv.events import BlockStored
from tests.engine.prompts import CHAT_PROMPTS, RAW_PROMPTS
from tests.helpers import assert_all_blocks_free

pytestmark = pytest.mark.model

SCORE_ATOL = 1e-3  # logits agree to ~2e-3 (test_hf_parity); summed scores agree far closer


def hf_beam_search(
    hf_model, prompt_ids: list[int], k: int, max_tokens: int, **options
) -> list[tuple[list[int], float]]:
    """HF's returned beams, best first: (generated token ids, the final EOS included; score)."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids], device=hf_model.device),
            num_beams=k,
            do_sample=False,
            max_new_tokens=max_tokens,
            num_return_sequences=k,
            return_dict_in_generate=True,
            output_scores=True,
            **options,
        )
    beams = []
    for sequence, score, beam_indices in zip(out.sequences, out.sequences_scores, out.beam_indices):
        num_generated = int((beam_indices >= 0).sum())  # the rest is padding
        generated = sequence[len(prompt_ids) : len(prompt_ids) + num_generated].tolist()
        beams.append((generated, float(score)))
    return beams


def assert_same_beams(got, expected) -> None:
    assert [c.token_ids for c in got.outputs] == [tokens for tokens, _ in expected]
    for completion, (_, score) in zip(got.outputs, expected):
        assert completion.score == pytest.approx(score, abs=SCORE_ATOL)


@pytest.fixture(scope="module")
def raw_prompt_ids(llm) -> list[list[int]]:
    return [llm.engine.processor.encode_prompt(p) for p in RAW_PROMPTS[:4]]


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beam_search_matches_hf(llm, hf_model, raw_prompt_ids, beam_width):
    llm.reset_prefix_cache()
    outs = llm.beam_search(raw_prompt_ids, beam_width=beam_width, max_tokens=5, use_tqdm=False)
    assert len(outs) == len(raw_prompt_ids)
    for ids, out in zip(raw_prompt_ids, outs):
        assert_same_beams(out, hf_beam_search(hf_model, ids, beam_width, 5))
        assert len(out.outputs) == beam_width
        best = out.outputs[0]
        # The score is the cumulative logprob over the generated length (length_penalty 1).
        assert best.score == pytest.approx(best.cumulative_logprob / len(best.token_ids), rel=1e-5)
        assert best.text == llm.tokenizer.decode(best.token_ids, skip_special_tokens=True)
    assert_all_blocks_free(llm)


# early_stopping=True and more penalties: tests/engine/test_beam_search_algorithm.py (tiny model).
@pytest.mark.parametrize(("length_penalty", "early_stopping"), [(1.0, False), (0.5, "never")])
def test_eos_ends_beams_early_like_hf(llm, hf_model, length_penalty, early_stopping):
    # The model answers this question and ends its turn within the budget on some beams.
    ids = llm.engine.processor.encode_chat(CHAT_PROMPTS[0])[1]
    out = llm.beam_search(
        ids, beam_width=3, max_tokens=9, length_penalty=length_penalty,
        early_stopping=early_stopping, use_tqdm=False,
    )[0]
    expected = hf_beam_search(
        hf_model, ids, 3, 9, length_penalty=length_penalty, early_stopping=early_stopping
    )
    assert_same_beams(out, expected)
    eos = llm.engine.eos_token_ids
    ended = [c for c in out.outputs if c.finish_reason == "stop"]
    assert ended and all(c.token_ids[-1] in eos and len(c.token_ids) <= 9 for c in ended)
    assert_all_blocks_free(llm)


def test_all_beams_of_all_requests_share_one_forward_per_step(llm, raw_prompt_ids, monkeypatch):
    steps: list[list[tuple[str, bool]]] = []  # per forward: (sequence id, returns a row)
    runner = llm.engine.runner
    execute = runner.execute

    def recording_execute(output):
        if output.sequences:
            steps.append([(s.request_id, s.return_logprobs_row) for s in output.sequences])
        return execute(output)

    monkeypatch.setattr(runner, "execute", recording_execute)
    num_steps_before = llm.engine.num_steps
    outs = llm.beam_search(raw_prompt_ids[:2], beam_width=3, max_tokens=4, use_tqdm=False)
    assert len(steps) == llm.engine.num_steps - num_steps_before  # one forward per step
    # Every sequence of a search returns log-probabilities, never a sampled token.
    assert all(row for step in steps for _, row in step)
    # The prompts' step, then every step carries each request's 3 beams (forks of its root).
    assert sorted(rid for rid, _ in steps[0]) == sorted(o.request_id for o in outs)
    for step in steps[1:]:
        roots = sorted(rid.split("#beam")[0] for rid, _ in step)
        assert roots == sorted(o.request_id for o in outs for _ in range(3))
        assert len({rid for rid, _ in step}) == 6  # six distinct beams
    assert len(steps) == 4  # the prompts, then one step per further token
    assert_all_blocks_free(llm)


def test_pruned_beams_never_publish_blocks_and_final_ones_do():
    llm = LLM(num_blocks=256, block_size=8, enable_kv_events=True)
    stored: list[tuple[int, BlockStored]] = []
    llm.subscribe_kv_events(
        lambda events: stored.extend(
            (llm.engine.num_steps, e) for e in events if isinstance(e, BlockStored)
        )
    )
    prompt = "Once upon a time, in a small village by the sea,"
    out = llm.beam_search(prompt, beam_width=3, max_tokens=12, use_tqdm=False)[0]
    last_step = llm.engine.num_steps
    prompt_ids = out.prompt_token_ids
    num_prompt_blocks = len(prompt_ids) // 8
    prompt_events = [e for _, e in stored[:num_prompt_blocks]]
    assert [e.token_ids for e in prompt_events] == [
        tuple(prompt_ids[i * 8 : i * 8 + 8]) for i in range(num_prompt_blocks)
    ]
    # Every block filled by generated tokens was published at the very end, and belongs to a
    # returned beam (the KV of a beam's final token is never computed).
    final_blocks = {
        tuple((prompt_ids + c.token_ids)[i * 8 : i * 8 + 8])
        for c in out.outputs
        for i in range(num_prompt_blocks, (len(prompt_ids) + len(c.token_ids) - 1) // 8)
    }
    decode_events = stored[num_prompt_blocks:]
    assert decode_events and all(step == last_step for step, _ in decode_events)
    assert {e.token_ids for _, e in decode_events} == final_blocks
    assert_all_blocks_free(llm)


def test_preempted_beam_search_restarts_and_gives_the_same_beams(llm, raw_prompt_ids):
    expected = llm.beam_search(raw_prompt_ids, beam_width=2, max_tokens=12, use_tqdm=False)
    small = LLM(num_blocks=14, block_size=8)
    got = small.beam_search(raw_prompt_ids, beam_width=2, max_tokens=12, use_tqdm=False)
    assert small.get_metrics().num_preemptions > 0
    for a, b in zip(got, expected):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert_all_blocks_free(small)


def test_beam_search_runs_beside_sampled_requests(llm, raw_prompt_ids):
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    alone = llm.generate([raw_prompt_ids[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    expected = llm.beam_search(raw_prompt_ids[1], beam_width=2, max_tokens=5, use_tqdm=False)[0]
    engine.add_request("mixed-greedy", engine.processor.process(raw_prompt_ids[0]), greedy)
    engine.add_beam_request(
        "mixed-beam", engine.processor.process(raw_prompt_ids[1]), BeamSearchParams(2, 5)
    )
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["mixed-greedy"].outputs[0].token_ids == alone
    got_beams = [c.token_ids for c in done["mixed-beam"].outputs]
    assert got_beams == [c.token_ids for c in expected.outputs]
    assert_all_blocks_free(llm)


def test_abort_frees_every_beam(llm, raw_prompt_ids):
    engine = llm.engine
    prompt = engine.processor.process(raw_prompt_ids[0])
    engine.add_beam_request("to-abort", prompt, BeamSearchParams(3, 20))
    for _ in range(4):
        engine.step()
    assert engine.kv_manager.num_free_blocks < engine.kv_manager.num_blocks
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_bad_beam_search_input_is_a_value_error(llm):
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search("Hi", beam_width=0, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search("Hi", max_tokens=0, use_tqdm=False)
    with pytest.raises(ValueError, match="early_stopping"):
        llm.beam_search("Hi", early_stopping="sometimes", use_tqdm=False)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.beam_search("Hi", beam_width=64, max_tokens=200, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_all_blocks_free(llm)
