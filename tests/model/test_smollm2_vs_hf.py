"""The bundled SmolLM2 GGUF through kvmemo vs transformers' own GGUF loader (same file, fp32)."""

from __future__ import annotations

import os

import pytest
import torch

from kvmemo.model.loading.loader import LoadedModel, load_model
from kvmemo.model.models.dense_attention import dense_causal_attention

pytestmark = pytest.mark.model
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return load_model()


@pytest.fixture(scope="module")
def theirs(hf_model):
    """transformers' own GGUF dequantization and de-permutation, in a transformers Llama: the
    session's reference model (conftest), loaded once for every module that compares with it."""
    return hf_model


def _last_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    config = loaded.arch_config
    attention = dense_causal_attention(config.num_attention_heads, config.num_key_value_heads)
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), attention)  # [T, hidden]
    return loaded.model.compute_logits(hidden[-1:])[0]  # [V]


def test_state_matches_transformers_gguf_loader(ours: LoadedModel, theirs) -> None:
    """Our de-permuted, fused parameters equal transformers' tensors (concatenated likewise)."""
    hf_state = theirs.state_dict()
    for param, names in ours.model._weight_plan():
        expected = torch.cat([hf_state[n] for n in names], dim=0)
        diff = (param - expected).abs().max().item()
        assert diff < 1e-6, f"{names}: max |diff| = {diff:.3g}"


def test_metadata(ours: LoadedModel) -> None:
    config = ours.arch_config
    shape = (config.architecture, config.num_hidden_layers, config.num_key_value_heads)
    assert shape == ("llama", 30, 3)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)
    assert ours.chat_template and "<|im_start|>" in ours.chat_template
    assert len(ours.weights_fingerprint) == 64
    assert ours.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_last_position_logits_match(ours: LoadedModel, theirs) -> None:
    for prompt in PROMPTS:
        ids = ours.tokenizer(prompt).input_ids
        ours_logits = _last_logits(ours, ids)
        with torch.no_grad():
            hf_logits = theirs(torch.tensor([ids])).logits[0, -1].float()
        diff = (ours_logits - hf_logits).abs().max().item()
        print(f"{prompt!r}: max |logits diff| = {diff:.3g}")
        assert diff < 1e-3, f"{prompt!r}: max |logits diff| = {diff:.3g}"


def test_greedy_tokens_match(ours: LoadedModel, theirs) -> None:
    for prompt in PROMPTS[:2]:
        ids = ours.tokenizer(prompt).input_ids
        ours_ids, hf_ids = list(ids), list(ids)
        for _ in range(32):  # plain argmax, past EOS too (generate() would mask EOS)
            ours_ids.append(int(_last_logits(ours, ours_ids).argmax()))
            with torch.no_grad():
                hf_ids.append(int(theirs(torch.tensor([hf_ids])).logits[0, -1].argmax()))
        assert ours_ids == hf_ids, ours.tokenizer.decode(ours_ids[len(ids):])
