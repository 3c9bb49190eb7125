"""kvmemo's LLaVA path == transformers' LlavaForConditionalGeneration on a tiny random checkpoint:
pixels, image features, prompt logits and greedy tokens (with and without chunked prefill)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmemo import SamplingParams
from kvmemo.model.models.image_processor import (
    ImageProcessorConfig,
    content_hash,
    load_image,
    preprocess,
)
from tests.multimodal.tiny_llava import NUM_IMAGE_TOKENS, picture

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT = "USER: <image>\nWhat is shown here? Answer in detail. ASSISTANT:"


def _hf_greedy(hf, input_ids, pixel_values) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            input_ids=input_ids,
            pixel_values=pixel_values,
            max_new_tokens=GREEDY.max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, input_ids.shape[1] :].tolist()


def _hf_inputs(llava, prompt_token_ids, images):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil.from_pretrained(str(llava[0]))
    pixel_values = processor(images=images, return_tensors="pt")["pixel_values"]
    return torch.tensor([prompt_token_ids]), pixel_values


def test_pixels_match_the_hf_image_processor(llava) -> None:
    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    hf = CLIPImageProcessorPil.from_pretrained(str(llava[0]))
    config = ImageProcessorConfig.from_dir(llava[0])
    rgba = Image.fromarray(
        np.random.default_rng(5).integers(0, 256, (30, 61, 4), dtype=np.uint8), "RGBA"
    )
    gray = Image.fromarray(np.random.default_rng(6).integers(0, 256, (90, 33), dtype=np.uint8), "L")
    for image in (picture(1), picture(2, (200, 120)), rgba, gray):
        theirs = hf(images=[image], return_tensors="np")["pixel_values"][0]
        ours = preprocess(load_image(image), config)
        assert ours.shape == theirs.shape == (3, 28, 28)
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


def test_prompt_logits_and_greedy_tokens_match_hf(llava, llm_on, llm_off) -> None:
    hf = llava[1]
    image = picture(11)
    runs = {}
    for name, llm in (("chunked+cache", llm_on), ("one chunk", llm_off)):
        llm.engine.runner.capture_logits = True
        try:
            first = llm.generate(
                {"prompt": PROMPT, "images": [image]},
                SamplingParams(temperature=0.0, max_tokens=1),
                use_tqdm=False,
            )[0]
            logits = llm.engine.runner.last_logits[0]
        finally:
            llm.engine.runner.capture_logits = False
        out = llm.generate({"prompt": PROMPT, "images": [image]}, GREEDY, use_tqdm=False)[0]
        runs[name] = (first.prompt_token_ids, logits, out.outputs[0].token_ids)

    prompt_ids = runs["one chunk"][0]
    assert prompt_ids.count(llava[1].config.image_token_id) == NUM_IMAGE_TOKENS
    input_ids, pixel_values = _hf_inputs(llava, prompt_ids, [image])
    with torch.no_grad():
        hf_logits = hf(input_ids=input_ids, pixel_values=pixel_values).logits[0, -1].float()
    hf_tokens = _hf_greedy(hf, input_ids, pixel_values)
    top2 = hf_logits.topk(2).values
    assert top2[0] - top2[1] > 1e-3, "tiny model's top logits are too close to test greedy"
    for name, (ids, logits, tokens) in runs.items():
        assert ids == prompt_ids
        diff = (logits - hf_logits).abs().max().item()
        assert diff < 1e-3, f"{name}: max |logits - HF| = {diff:.3g}"
        assert tokens == hf_tokens, name


def test_two_images_in_one_prompt_match_hf(llava, llm_on) -> None:
    hf = llava[1]
    images = [picture(21), picture(22, (64, 30))]
    prompt = "USER: <image> first, then <image> second. Compare them. ASSISTANT:"
    out = llm_on.generate({"prompt": prompt, "images": images}, GREEDY, use_tqdm=False)[0]
    input_ids, pixel_values = _hf_inputs(llava, out.prompt_token_ids, images)
    assert out.outputs[0].token_ids == _hf_greedy(hf, input_ids, pixel_values)


def test_one_picture_one_hash_whatever_the_source(tmp_path, llava) -> None:
    import base64

    from tests.multimodal.tiny_llava import png_bytes

    config = ImageProcessorConfig.from_dir(llava[0])
    image = picture(31)
    data = png_bytes(image)
    path = tmp_path / "p.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    hashes = {
        content_hash(preprocess(load_image(src), config), config)
        for src in (image, data, str(path), path, url)
    }
    assert len(hashes) == 1
    assert content_hash(preprocess(picture(32), config), config) not in hashes
    other = ImageProcessorConfig.from_dict(
        {"size": {"shortest_edge": 28}, "crop_size": 28, "image_mean": [0.5] * 3}
    )
    assert content_hash(preprocess(image, other), other) not in hashes  # settings join the hash


@pytest.mark.parametrize(
    ("source", "match"),
    [
        (b"not an image", "cannot decode"),
        ("data:image/png;base64,@@@", "invalid base64"),
        ("https://example.com/cat.png", "remote URLs"),
        ("/no/such/file.png", "no such file"),
        (3.5, "must be a PIL image"),
    ],
)
def test_bad_images_raise_value_error(source, match) -> None:
    with pytest.raises(ValueError, match=match):
        load_image(source)


def test_oversized_image_is_refused(monkeypatch) -> None:
    import kvmemo.model.models.image_processor as image_processor

    monkeypatch.setattr(image_processor, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ValueError, match="outside the allowed"):
        load_image(picture(1))


def test_marker_count_must_match_images(llm_on, llm_off) -> None:
    with pytest.raises(ValueError, match="1 image marker.*2 image"):
        llm_on.generate({"prompt": PROMPT, "images": [picture(1), picture(2)]}, use_tqdm=False)
    # a prompt without any marker: the images go first, as the CLI's --image does
    params = SamplingParams(max_tokens=4, temperature=0.0)
    unmarked = PROMPT.replace("<image>\n", "")
    placed = llm_on.generate({"prompt": unmarked, "images": [picture(1)]}, params,
                             use_tqdm=False)[0]
    explicit = llm_on.generate({"prompt": "<image>\n" + unmarked, "images": [picture(1)]},
                               params, use_tqdm=False)[0]
    assert placed.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert placed.prompt_token_ids == explicit.prompt_token_ids
    with pytest.raises(ValueError, match="'prompt' \\(required\\) and 'images'"):
        llm_on.generate({"text": PROMPT}, use_tqdm=False)


def _relayout(state_dict: dict, style: str) -> dict:
    """The tiny checkpoint's keys as other generations of transformers / llava-hf save them."""
    out = {}
    for key, value in state_dict.items():
        if style == "llava-1.5":  # llava-hf/llava-1.5-*-hf: CLIPVisionModel under vision_tower
            key = key.replace("vision_tower.", "vision_tower.vision_model.", 1)
        elif style == "transformers-4.52":  # LlavaModel nested under "model."
            for old, new in (
                ("language_model.model.", "model.language_model."),
                ("language_model.lm_head.", "lm_head."),
                ("vision_tower.", "model.vision_tower.vision_model."),
                ("multi_modal_projector.", "model.multi_modal_projector."),
            ):
                if key.startswith(old):
                    key = new + key[len(old) :]
                    break
        out[key] = value
    return out


@pytest.mark.parametrize("style", ["llava-1.5", "transformers-4.52"])
def test_other_checkpoint_layouts_load_the_same(llava, llm_off, style) -> None:
    import json

    from kvmemo.model.loading.safetensors import load_state_dict
    from kvmemo.model.models.llava import LlavaConfig, LlavaForConditionalGeneration

    raw = json.loads((llava[0] / "config.json").read_text())
    config = LlavaConfig.from_hf(raw)
    state_dict = _relayout(load_state_dict(llava[0]), style)
    model = LlavaForConditionalGeneration.from_state_dict(config, state_dict)
    reference = llm_off.engine.runner.model
    pixels = torch.from_numpy(preprocess(picture(41), ImageProcessorConfig.from_dir(llava[0])))
    assert torch.equal(model.encode_images(pixels[None]), reference.encode_images(pixels[None]))
    for name, param in reference.language_model.named_parameters():
        assert torch.equal(param, dict(model.language_model.named_parameters())[name]), name


def test_sparse_llava_15_config_takes_llama_defaults() -> None:
    from kvmemo.model.models.llava import LlavaConfig

    # llava-hf/llava-1.5-7b-hf's config.json, abridged: the text config lists only differences.
    raw = {
        "model_type": "llava",
        "image_token_index": 32000,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "text_config": {
            "model_type": "llama",
            "vocab_size": 32064,
            "rms_norm_eps": 1e-05,
            "max_position_embeddings": 4096,
            "architectures": ["LlamaForCausalLM"],
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "image_size": 336,
            "patch_size": 14,
        },
    }
    config = LlavaConfig.from_hf(raw)
    assert (config.text.hidden_size, config.text.num_hidden_layers, config.text.vocab_size) == (
        4096,
        32,
        32064,
    )
    assert config.num_image_tokens == 576 and config.image_token_id == 32000
