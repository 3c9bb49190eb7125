"""A tiny random LLaVA checkpoint (CLIP vision tower, Llama text model) saved the HF way, with the
bundled SmolLM2 tokenizer plus an <image> token, and deterministic test pictures."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

IMAGE_SIZE = 28  # vision input side; patch 7 -> 16 patches -> 16 placeholder tokens per image
NUM_IMAGE_TOKENS = 16


def build_tiny_llava(directory: Path, *, seed: int = 0, init_std: float = 0.15) -> torch.nn.Module:
    """Save a random LlavaForConditionalGeneration with tokenizer and image processor into
    `directory`; returns the HF model (fp32, eval).

    init_std is far above HF's 0.02 so that logits are spread out and greedy argmax is not
    decided by float noise; the projector is scaled up so images move the output.
    """
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from kvmemo.model.loader import bundled_model_path, fingerprint_files
    from kvmemo.model.tokenizer_cache import load_gguf_tokenizer

    gguf = Path(bundled_model_path())
    tokenizer = load_gguf_tokenizer(gguf, fingerprint_files([gguf], gguf.parent))
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=7,
        projection_dim=16,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=init_std,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token_id,
        image_seq_length=NUM_IMAGE_TOKENS,
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomize so they are tested
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
            elif "vision_tower" in name or "multi_modal_projector" in name:
                param.normal_(0.0, init_std * 2)
    model = model.float().eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(directory)
    return model


def picture(seed: int, size: tuple[int, int] = (40, 52)):
    """A deterministic RGB noise picture (PIL), not square, so resize and crop both matter."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
