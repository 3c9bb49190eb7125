"""Beam search over an image prompt: the image reaches the model (beam width 1 is greedy, as in
HF), beams of an image prompt run with caching on and off alike, and every block is freed."""

from __future__ import annotations

from kvmemo import SamplingParams
from tests.multimodal.tiny_llava import picture

PROMPT = "USER: <image>\nDescribe the picture. ASSISTANT:"


def test_beam_width_one_equals_greedy_on_an_image_prompt(llm_on) -> None:
    prompt = {"prompt": PROMPT, "images": [picture(7)]}
    greedy = llm_on.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                             use_tqdm=False)[0]
    beams = llm_on.beam_search(prompt, beam_width=1, max_tokens=5, use_tqdm=False)[0]
    assert beams.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_image_beams_are_equal_with_caching_on_and_off(llm_on, llm_off) -> None:
    results = []
    for llm in (llm_on, llm_off, llm_on):  # the second run on llm_on starts from cached blocks
        out = llm.beam_search([{"prompt": PROMPT, "images": [picture(8)]}], beam_width=3,
                              max_tokens=4, use_tqdm=False)[0]
        results.append([(b.token_ids, round(b.score, 4)) for b in out.outputs])
    assert len(results[0]) == 3
    assert results[0] == results[1] == results[2]
