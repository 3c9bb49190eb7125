"""EncoderCache: least recently used out first, bounded by bytes, hits counted."""

from __future__ import annotations

import pytest
import torch

from kvmemo.engine.encoder_cache import EncoderCache


def _features(value: float) -> torch.Tensor:
    return torch.full((4, 8), value, dtype=torch.float32)  # 4 * 8 * 4 = 128 bytes


def test_lru_eviction_under_a_byte_budget() -> None:
    cache = EncoderCache(capacity_bytes=300)  # room for two entries of 128 bytes
    cache.put(b"a", _features(1))
    cache.put(b"b", _features(2))
    assert cache.total_bytes == 256
    assert cache.get(b"a") is not None  # a is now the most recently used
    cache.put(b"c", _features(3))  # evicts b, the least recently used
    assert b"b" not in cache and b"a" in cache and b"c" in cache
    assert cache.total_bytes == 256 and cache.stats.num_evicted == 1
    assert torch.equal(cache.get(b"c"), _features(3))
    assert cache.get(b"b") is None
    assert cache.stats.num_hits == 2


def test_entry_larger_than_capacity_is_not_stored() -> None:
    cache = EncoderCache(capacity_bytes=100)
    cache.put(b"big", _features(1))
    assert len(cache) == 0 and cache.total_bytes == 0
    with pytest.raises(ValueError, match="capacity"):
        EncoderCache(capacity_bytes=-1)


def test_features_survive_eviction_in_the_step_that_needs_them(llm_on) -> None:
    """With a cache too small for even one image, every step encodes what it needs itself, and
    chunked prefill (an image split across steps) still gives the right tokens."""
    from kvmemo import SamplingParams
    from tests.multimodal.tiny_llava import NUM_IMAGE_TOKENS, picture

    cache = llm_on.engine.runner.encoder_cache
    saved = cache.capacity_bytes
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    text = "USER: here are quite a few words of text before the picture, so that it"
    prompt = {"prompt": text + " <image>\nand after. ASSISTANT:", "images": [picture(701)]}
    try:
        llm_on.reset_prefix_cache()
        cache.clear()
        cache.capacity_bytes = 0
        before = llm_on.get_metrics().mm_encoder_images
        small = llm_on.generate(prompt, params, use_tqdm=False)[0]
        offset = small.prompt_token_ids.index(llm_on.engine.processor.image_input.image_token_id)
        budget = llm_on.config.max_num_batched_tokens
        assert offset < budget < offset + NUM_IMAGE_TOKENS  # the first chunk ends inside the image
        assert llm_on.get_metrics().mm_encoder_images - before == 2  # so it is encoded twice
    finally:
        cache.capacity_bytes = saved
    llm_on.reset_prefix_cache()
    roomy = llm_on.generate(prompt, params, use_tqdm=False)[0]
    assert small.outputs[0].token_ids == roomy.outputs[0].token_ids
