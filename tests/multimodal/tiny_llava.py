"""Random LLaVA checkpoints (CLIP vision tower, Llama text model) saved the HF way, with the
bundled SmolLM2 tokenizer plus an <image> token, and deterministic test pictures."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

IMAGE_SIZE = 28  # the test model: patch 7 -> 16 patches -> 16 placeholder tokens per image
NUM_IMAGE_TOKENS = 16


def save_random_llava(
    directory: Path,
    *,
    image_size: int,
    patch_size: int,
    vision: dict[str, Any],
    text: dict[str, Any],
    seed: int = 0,
    init_std: float = 0.02,
    spread: bool = False,
) -> torch.nn.Module:
    """Save a random LlavaForConditionalGeneration, its tokenizer and its image processor config
    into `directory`; returns the HF model (fp32, eval).

    spread=True randomizes norms and biases (HF inits them to 1 and 0, which would leave them
    untested) and widens the vision tower and projector weights, so that images move the output.
    """
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from kvmemo.model.loading.loader import bundled_model_path, fingerprint_files
    from kvmemo.model.loading.tokenizer import load_gguf_tokenizer

    gguf = Path(bundled_model_path())
    tokenizer = load_gguf_tokenizer(gguf, fingerprint_files([gguf], gguf.parent))
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    num_image_tokens = (image_size // patch_size) ** 2
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(image_size=image_size, patch_size=patch_size, **vision),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            initializer_range=init_std,
            **text,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=num_image_tokens,
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    if spread:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    param.add_(0.1 * torch.randn_like(param))
                elif "vision_tower" in name or "multi_modal_projector" in name:
                    param.normal_(0.0, init_std * 2)
    model = model.float().eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    size = {"shortest_edge": image_size}
    CLIPImageProcessorPil(
        size=size, crop_size={"height": image_size, "width": image_size}
    ).save_pretrained(directory)
    return model


def build_tiny_llava(directory: Path, *, seed: int = 0) -> torch.nn.Module:
    """The test model: 3 vision layers, 2 text layers, 16 image tokens.

    init_std 0.15 is far above HF's 0.02, so logits are spread out and greedy argmax is not
    decided by float noise.
    """
    return save_random_llava(
        directory,
        image_size=IMAGE_SIZE,
        patch_size=7,
        vision=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4
        ),
        text=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
        seed=seed,
        init_std=0.15,
        spread=True,
    )


def picture(seed: int, size: tuple[int, int] = (40, 52)):
    """A deterministic RGB noise picture (PIL), not square, so resize and crop both matter."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
