"""A tiny random Llama checkpoint (HF safetensors) with the bundled model's tokenizer: an engine
that loads in a second, for GPU checks that need no real weights (CUDA graphs against eager
steps). scripts/gpu_carry.sh saves one into .gpu/tiny_llama for a GPU machine without the
bundled model."""

from __future__ import annotations

from pathlib import Path

import torch

CARRIED = Path(__file__).resolve().parents[2] / ".gpu" / "tiny_llama"


def save_tiny_llama(directory: Path, seed: int = 0, **overrides: object) -> None:
    """A random Llama (3 layers, hidden 96, GQA 3 by default; `overrides` replace LlamaConfig
    fields, e.g. a vocab_size below the tokenizer's: the ids under it keep their texts)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvmemo.model.loading.loader import bundled_model_path, fingerprint_files
    from kvmemo.model.loading.tokenizer import load_gguf_tokenizer

    gguf = Path(bundled_model_path())
    tokenizer = load_gguf_tokenizer(gguf, fingerprint_files([gguf], gguf.parent))
    dims: dict = dict(
        vocab_size=len(tokenizer), hidden_size=96, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True, initializer_range=0.1,
    )
    config = LlamaConfig(**{**dims, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def tiny_llama_dir(tmp_path: Path) -> Path:
    """The carried checkpoint where there is one, else a fresh one under tmp_path."""
    if (CARRIED / "config.json").is_file():
        return CARRIED
    save_tiny_llama(tmp_path)
    return tmp_path
