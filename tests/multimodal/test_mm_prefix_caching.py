"""Prefix caching with images: blocks that touch an image are keyed by its content, so equal
placeholder tokens never share KV across different pictures, and a fully cached image is never
encoded again. Every output is checked against an engine with prefix caching off."""

from __future__ import annotations

from kvmemo import SamplingParams
from tests.multimodal.tiny_llava import NUM_IMAGE_TOKENS, picture

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK = 8


def _ids(llm, text: str) -> list[int]:
    return llm.tokenizer(text, add_special_tokens=False)["input_ids"]


def _image_token(llm) -> int:
    return llm.engine.processor.image_input.image_token_id


def _run(llm, prompt, images):
    return llm.generate({"prompt": prompt, "images": images}, GREEDY, use_tqdm=False)[0]


def _encoded(llm) -> int:
    return llm.get_metrics().mm_encoder_images


def test_same_image_and_text_is_fully_reused(llm_on, llm_off) -> None:
    llm_on.reset_prefix_cache()
    prompt = "USER: <image>\nWhat colour dominates this picture? ASSISTANT:"
    first = _run(llm_on, prompt, [picture(101)])
    second = _run(llm_on, prompt, [picture(101)])
    cold = _run(llm_off, prompt, [picture(101)])
    num_prompt = len(first.prompt_token_ids)
    assert first.metrics.num_cached_tokens == 0
    # Every full block of the prompt is a hit, except that the last prompt token is recomputed.
    assert second.metrics.num_cached_tokens == (num_prompt - 1) // BLOCK * BLOCK
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == cold.outputs[0].token_ids


def test_different_image_same_placeholders_reuses_no_image_block(llm_on, llm_off) -> None:
    llm_on.reset_prefix_cache()
    text = _ids(llm_on, "A long shared system preamble that fills a few blocks of text. USER:")
    tail = _ids(llm_on, " Describe the image. ASSISTANT:")
    prompt = text + [_image_token(llm_on)] + tail
    a = _run(llm_on, prompt, [picture(201)])
    b = _run(llm_on, prompt, [picture(202)])
    assert a.prompt_token_ids == b.prompt_token_ids  # identical tokens, placeholders included
    # Only the blocks wholly before the image may be shared.
    assert b.metrics.num_cached_tokens == len(text) // BLOCK * BLOCK
    assert b.outputs[0].token_ids != a.outputs[0].token_ids
    assert b.outputs[0].token_ids == _run(llm_off, prompt, [picture(202)]).outputs[0].token_ids
    assert a.outputs[0].token_ids == _run(llm_off, prompt, [picture(201)]).outputs[0].token_ids


def test_same_image_at_another_position(llm_on, llm_off) -> None:
    llm_on.reset_prefix_cache()
    head = _ids(llm_on, "Shared preamble about pictures and what they show to us. USER:")
    shift = _ids(llm_on, " Look carefully at this picture please now and then answer")[
        :BLOCK
    ]  # exactly one block
    assert len(shift) == BLOCK
    tail = _ids(llm_on, " What is in it? ASSISTANT: It is")
    image = [_image_token(llm_on)]
    base = head + image + tail
    shifted = head + shift + image + tail
    _run(llm_on, base, [picture(301)])
    moved = _run(llm_on, shifted, [picture(301)])
    # The image's blocks hold the same tokens at the same offsets relative to the image, but
    # chain from a different parent: only the blocks of `head` are shared.
    assert moved.metrics.num_cached_tokens == len(head) // BLOCK * BLOCK
    assert moved.outputs[0].token_ids == _run(llm_off, shifted, [picture(301)]).outputs[0].token_ids
    # Same image, same position, a different continuation: reuse runs through the image.
    other_tail = _ids(llm_on, " Which animal is it? ASSISTANT: Maybe")
    again = _run(llm_on, head + image + other_tail, [picture(301)])
    image_end = len(head) + NUM_IMAGE_TOKENS
    common = image_end + next(i for i, (x, y) in enumerate(zip(tail, other_tail)) if x != y)
    assert again.metrics.num_cached_tokens == common // BLOCK * BLOCK >= image_end // BLOCK * BLOCK
    assert (
        again.outputs[0].token_ids
        == _run(llm_off, head + image + other_tail, [picture(301)]).outputs[0].token_ids
    )


def test_mixed_batch_equals_caching_off(llm_on, llm_off) -> None:
    llm_on.reset_prefix_cache()
    a, b, c = picture(401), picture(402, (90, 45)), picture(403)
    q = "USER: <image>\nWhat do you see? ASSISTANT:"
    batch = [
        "The capital of France is",
        {"prompt": q, "images": [a]},
        {"prompt": q, "images": [b]},
        {"prompt": q, "images": [a]},
        "The capital of France is",
        {"prompt": "USER: <image> and <image>: which is brighter? ASSISTANT:", "images": [a, c]},
        {"prompt": "Some text only prompt that is long enough to span blocks of KV.", "images": []},
        {"prompt": q, "images": [c]},
        {"prompt": q, "images": [b]},
    ]
    on = llm_on.generate(batch, GREEDY, use_tqdm=False)
    on_again = llm_on.generate(batch, GREEDY, use_tqdm=False)  # now mostly cache hits
    off = llm_off.generate(batch, GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in off]
    assert [o.outputs[0].token_ids for o in on] == tokens
    assert [o.outputs[0].token_ids for o in on_again] == tokens
    assert sum(o.metrics.num_cached_tokens for o in on_again) > 0
    assert tokens[1] != tokens[2]  # the images matter


def test_fully_cached_image_is_not_encoded_again(llm_on) -> None:
    llm_on.reset_prefix_cache()
    cache = llm_on.engine.runner.encoder_cache
    prompt = "USER: <image>\nThe picture shows a scene; tell me everything about it. ASSISTANT:"
    before = _encoded(llm_on)
    first = _run(llm_on, prompt, [picture(501)])
    assert _encoded(llm_on) == before + 1
    cache.clear()  # so that only the KV prefix cache can spare the encoder
    second = _run(llm_on, prompt, [picture(501)])
    image_end = first.prompt_token_ids.index(_image_token(llm_on)) + NUM_IMAGE_TOKENS
    assert second.metrics.num_cached_tokens >= image_end  # every block of the image was a hit
    assert _encoded(llm_on) == before + 1  # ... so the encoder did not run
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # Without the KV (cache reset) and without cached features, it must run again.
    cache.clear()
    llm_on.reset_prefix_cache()
    third = _run(llm_on, prompt, [picture(501)])
    assert _encoded(llm_on) == before + 2
    # A KV miss with the features cached: served by the encoder cache, not the encoder.
    hits = llm_on.get_metrics().mm_encoder_cache_hits
    fourth = _run(llm_on, "Another prefix entirely. " + prompt, [picture(501)])
    assert _encoded(llm_on) == before + 2
    assert llm_on.get_metrics().mm_encoder_cache_hits > hits
    assert third.outputs[0].token_ids == first.outputs[0].token_ids
    assert fourth.metrics.num_cached_tokens == 0
