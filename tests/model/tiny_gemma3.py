"""A tiny random Gemma 3 checkpoint saved the HF way (safetensors + the bundled tokenizer), with
a short sliding window so that short prompts already cross it."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 16  # tokens; two blocks of 8
LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3


def save_tiny_gemma3(directory: Path, seed: int = 0) -> torch.nn.Module:
    """Saves a random Gemma3ForCausalLM (7 layers: 6 sliding, 1 full; query_pre_attn_scalar
    unlike head_dim, so the scale is tested) and returns it (fp32, eval)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvmemo.model.loading.loader import bundled_model_path, fingerprint_files
    from kvmemo.model.loading.tokenizer import load_gguf_tokenizer

    gguf = Path(bundled_model_path())
    tokenizer = load_gguf_tokenizer(gguf, fingerprint_files([gguf], gguf.parent))
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        max_position_embeddings=2048,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        initializer_range=0.1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # HF inits the (1 + w) norms' w to 0: randomize so they are tested
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model = model.float().eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model
