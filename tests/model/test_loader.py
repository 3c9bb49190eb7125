"""load_model(): HF directories end to end, fingerprints, and the user-facing errors."""

from __future__ import annotations

import pytest
import torch

from kvmemo.model.loading.loader import load_model
from tests.model.tiny import tiny_hf_model


def _save_tiny_dir(path, seed: int = 0) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny_hf_model("qwen2", seed=seed).save_pretrained(path, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 97)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(path)


def test_load_hf_directory(tmp_path) -> None:
    _save_tiny_dir(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.arch_config.architecture == "qwen2"
    assert loaded.path == str(tmp_path.resolve())
    assert loaded.chat_template and "messages" in loaded.chat_template
    assert loaded.tokenizer.eos_token == "</s>"
    assert load_model(str(tmp_path)).weights_fingerprint == loaded.weights_fingerprint

    other = tmp_path / "other"
    _save_tiny_dir(other, seed=1)
    assert load_model(str(other)).weights_fingerprint != loaded.weights_fingerprint


def test_bf16_model(tmp_path) -> None:
    _save_tiny_dir(tmp_path)
    loaded = load_model(str(tmp_path), dtype=torch.bfloat16)
    model = loaded.model
    # bf16 projections; the table, the head and the norms stay fp32 (LlamaForCausalLM.forward).
    assert model.compute_dtype == torch.bfloat16
    assert model.layers[0].qkv_proj.weight.dtype == torch.bfloat16
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == torch.float32
    assert model.layers[0].input_layernorm.weight.dtype == torch.float32
    assert model.norm.weight.dtype == torch.float32
    from kvmemo.model.models.dense_attention import dense_causal_attention

    seen: list[torch.dtype] = []

    def attention(layer, q, k, v):
        seen.append(q.dtype)
        return dense_causal_attention(4, 2)(layer, q, k, v)

    hidden = model(torch.tensor([3, 4, 5]), torch.arange(3), attention)
    assert hidden.dtype == torch.float32  # the residual stream
    assert set(seen) == {torch.bfloat16}  # attention computes in bf16
    assert model.compute_logits(hidden).dtype == torch.float32


def test_missing_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model(str(tmp_path / "does-not-exist"))


def test_directory_without_config(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        load_model(str(tmp_path / "weights.bin"))


def test_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match="float64"):
        load_model("/nonexistent", dtype=torch.float64)


@pytest.mark.parametrize(
    ("flags", "weights", "expected"),
    [
        ("flags : fpu avx2 avx512f avx512_bf16", "dense", torch.bfloat16),
        ("flags : fpu avx2 amx_bf16 amx_tile", "dense", torch.bfloat16),
        ("flags : fpu avx2 avx512f avx512_vnni", "dense", torch.float32),  # no bf16 products
        ("flags : fpu avx2 avx512_bf16", "native", torch.float32),  # int8 kernels: fp32 in
    ],
)
def test_auto_dtype_follows_the_cpu(monkeypatch, flags, weights, expected) -> None:
    from kvmemo.model.loading.loader import resolve_dtype

    monkeypatch.delenv("KVMEMO_DTYPE", raising=False)
    monkeypatch.setattr("kvmemo.native.cpu_flags", lambda: flags)
    assert resolve_dtype("auto", weights, "cpu") == expected


def test_dtype_names_and_override(monkeypatch) -> None:
    from kvmemo.model.loading.loader import resolve_dtype

    monkeypatch.setattr("kvmemo.native.cpu_flags", lambda: "flags : avx512_bf16")
    monkeypatch.setenv("KVMEMO_DTYPE", "float32")
    assert resolve_dtype("auto", "dense", "cpu") == torch.float32  # the override wins over auto
    assert resolve_dtype("bfloat16", "dense", "cpu") == torch.bfloat16  # but not over a name
    assert resolve_dtype(torch.float16, "dense", "cpu") == torch.float16
    monkeypatch.setenv("KVMEMO_DTYPE", "fp64")
    with pytest.raises(ValueError, match=r"'fp64'.*auto, float32, bfloat16, float16.*KVMEMO_DTYPE"):
        resolve_dtype("auto", "dense", "cpu")
    with pytest.raises(ValueError, match=r"'int8' not supported; allowed: auto"):
        resolve_dtype("int8", "dense", "cpu")


def test_auto_dtype_loads_bf16_on_a_bf16_cpu(tmp_path, monkeypatch) -> None:
    _save_tiny_dir(tmp_path)
    monkeypatch.delenv("KVMEMO_DTYPE", raising=False)
    monkeypatch.setattr("kvmemo.native.cpu_flags", lambda: "flags : avx512_bf16")
    loaded = load_model(str(tmp_path), dtype="auto")
    assert loaded.dtype == loaded.model.compute_dtype == torch.bfloat16
