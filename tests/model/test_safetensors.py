"""Tiny random HF Llama (llama3 rope) / Qwen2 checkpoints: kvmemo logits and greedy tokens == HF."""

from __future__ import annotations

import json

import pytest
import torch

from kvmemo.model.loading.safetensors import load_safetensors_dir
from kvmemo.model.models.dense_attention import dense_causal_attention
from kvmemo.model.models.llama import LlamaForCausalLM
from tests.model.tiny import tiny_hf_model


def _load(tmp_path, kind: str):
    hf = tiny_hf_model(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    state_dict, config = load_safetensors_dir(tmp_path)
    model = LlamaForCausalLM.from_state_dict(config, state_dict)
    attention = dense_causal_attention(config.num_attention_heads, config.num_key_value_heads)
    return hf, model, config, attention


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_logits_and_greedy_match_hf(tmp_path, kind: str) -> None:
    hf, model, config, attention = _load(tmp_path, kind)
    assert config.architecture == kind
    assert config.attention_bias == (kind == "qwen2")
    if kind == "llama":
        assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"

    ids = torch.randint(0, config.vocab_size, (80,), generator=torch.Generator().manual_seed(1))
    ours = model.compute_logits(model(ids, torch.arange(len(ids)), attention))  # [T, V]
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0].float()
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-4, f"{kind}: max |logits diff| = {diff:.3g}"

    seq_ours, seq_hf = ids[:5].tolist(), ids[:5].tolist()
    for _ in range(12):
        x = torch.tensor(seq_ours)
        hidden = model(x, torch.arange(len(x)), attention)  # [T, hidden]
        seq_ours.append(int(model.compute_logits(hidden[-1:]).argmax()))
        with torch.no_grad():
            seq_hf.append(int(hf(torch.tensor([seq_hf])).logits[0, -1].argmax()))
    assert seq_ours == seq_hf


def test_sharded_checkpoint_loads(tmp_path) -> None:
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    state_dict, _ = load_safetensors_dir(tmp_path)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(state_dict[name], tensor), name


def test_unsupported_architecture_in_config(tmp_path) -> None:
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_safetensors_dir(tmp_path)


def test_strict_load_weights(tmp_path) -> None:
    hf, model, config, _ = _load(tmp_path, "llama")
    state_dict = dict(hf.state_dict())
    del state_dict["model.layers.1.mlp.up_proj.weight"]
    state_dict["model.layers.9.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="missing.*up_proj.*unexpected.*extra"):
        model.load_weights(state_dict)
