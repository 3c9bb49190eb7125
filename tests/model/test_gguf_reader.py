"""GGUF reader: dequantization round trips, llama.cpp name mapping and Q/K un-permutation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from kvmemo.model.loading.gguf import (
    SUPPORTED_QUANT_TYPES,
    llama_permute,
    load_gguf,
    read_gguf,
    reverse_llama_permute,
)
from kvmemo.model.models.llama import LlamaForCausalLM
from tests.model.tiny import tiny_hf_model

Q = GGMLQuantizationType
# (type, max |error| relative to max |x|) for x ~ N(0, 1)
ROUND_TRIP_TYPES = [
    (Q.F32, 0.0), (Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 1e-2), (Q.Q5_0, 0.05),
    (Q.Q5_1, 0.05), (Q.Q4_0, 0.1), (Q.Q4_1, 0.1),
]


def _write(path, arch: str, tensors: dict[str, tuple[np.ndarray, Q | None]], **meta) -> None:
    writer = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        getattr(writer, f"add_{key}")(value)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("qtype", "tolerance"), ROUND_TRIP_TYPES, ids=lambda x: getattr(x, "name", "")
)
def test_dequantize_round_trip(tmp_path, qtype: Q, tolerance: float) -> None:
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    try:
        packed = quants.quantize(x, qtype)
    except NotImplementedError:
        pytest.skip(f"gguf cannot quantize {qtype.name}")
    raw_dtype = None if qtype in (Q.F32, Q.F16) else qtype
    _write(tmp_path / "t.gguf", "llama", {"w": (packed, raw_dtype)})
    _, tensors = read_gguf(tmp_path / "t.gguf")
    got = tensors["w"]
    assert got.dtype == torch.float32 and got.shape == (8, 512)
    err = (got - torch.from_numpy(x)).abs().max().item() / np.abs(x).max()
    assert err <= tolerance, f"{qtype.name}: relative error {err:.3g} > {tolerance}"
    assert torch.equal(got, torch.from_numpy(quants.dequantize(packed, qtype).astype(np.float32)))


def test_k_quants_are_supported() -> None:
    for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "BF16"):
        assert Q[name] in SUPPORTED_QUANT_TYPES


def test_unsupported_quant_type_is_a_clear_error(tmp_path) -> None:
    unsupported = next((t for t in (Q.Q8_K, Q.Q8_1) if t not in SUPPORTED_QUANT_TYPES), None)
    if unsupported is None:
        pytest.skip("every type this test knows is supported by the installed gguf")
    block_size, type_size = quants.GGML_QUANT_SIZES[unsupported]
    raw = np.zeros((2, 2 * type_size), dtype=np.uint8)  # 2 rows of 2 blocks
    _write(tmp_path / "bad.gguf", "llama", {"w": (raw, unsupported)})
    with pytest.raises(ValueError, match=f"{unsupported.name}.*supported:.*Q4_1"):
        read_gguf(tmp_path / "bad.gguf")


def test_permutation_round_trip() -> None:
    w = torch.randn(4 * 16, 24)  # 4 heads of dim 16
    assert torch.equal(reverse_llama_permute(llama_permute(w, 4), 4), w)
    assert not torch.equal(llama_permute(w, 4), w)
    b = torch.randn(4 * 16)
    assert torch.equal(reverse_llama_permute(llama_permute(b, 4), 4), b)


def _tiny_llama_gguf(path, hf: torch.nn.Module, types: dict[str, Q] | None = None) -> None:
    """What convert_hf_to_gguf writes for a llama: renamed tensors, q/k rows permuted; `types`
    quantizes the weights of the named llama.cpp tensors (attn_q, token_embd, ...)."""
    cfg = hf.config
    names = {
        "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    tensors = {}
    for hf_name, tensor in hf.state_dict().items():
        stem, kind = hf_name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, rest = stem.split(".", 3)
            name = f"blk.{layer}.{names[rest]}.{kind}"
        else:
            name = f"{names[stem]}.{kind}"
        if "q_proj" in hf_name:
            tensor = llama_permute(tensor, cfg.num_attention_heads)
        elif "k_proj" in hf_name:
            tensor = llama_permute(tensor, cfg.num_key_value_heads)
        part = name.split(".")[-2]
        qtype = (types or {}).get(part)
        if qtype is not None and kind == "weight":
            tensors[name] = (quants.quantize(tensor.numpy().astype(np.float32), qtype), qtype)
        else:
            tensors[name] = (tensor.numpy(), None)
    _write(
        path, "llama", tensors,
        block_count=cfg.num_hidden_layers, context_length=cfg.max_position_embeddings,
        embedding_length=cfg.hidden_size, feed_forward_length=cfg.intermediate_size,
        head_count=cfg.num_attention_heads, head_count_kv=cfg.num_key_value_heads,
        layer_norm_rms_eps=cfg.rms_norm_eps, rope_freq_base=10000.0,
        bos_token_id=1, eos_token_id=2, chat_template="{{ messages }}",
    )


def test_tiny_llama_gguf_recovers_hf_weights(tmp_path) -> None:
    hf = tiny_hf_model("llama")
    _tiny_llama_gguf(tmp_path / "tiny.gguf", hf)
    checkpoint = load_gguf(tmp_path / "tiny.gguf")
    expected = hf.state_dict()
    assert checkpoint.state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(checkpoint.state_dict[name], tensor), name
    config = checkpoint.arch_config
    assert (config.architecture, config.num_hidden_layers, config.head_dim) == ("llama", 2, 16)
    assert (config.num_key_value_heads, config.tie_word_embeddings) == (2, False)
    assert checkpoint.chat_template == "{{ messages }}"
    assert (checkpoint.bos_token_id, checkpoint.eos_token_ids) == (1, (2,))
    LlamaForCausalLM.from_state_dict(config, checkpoint.state_dict)  # strict load succeeds


def test_unsupported_gguf_architecture(tmp_path) -> None:
    embed = np.zeros((4, 8), np.float32)
    _write(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": (embed, None)})
    with pytest.raises(ValueError, match="'gpt2'.*supported: llama, qwen2, mistral"):
        load_gguf(tmp_path / "gpt2.gguf")


def test_missing_gguf_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")
