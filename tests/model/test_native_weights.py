"""weights="native": a GGUF's linear weights stay at their own bits (mixed types in one file,
llama's permuted q/k rows included) and the model computes what the dequantized ("dense") one
does; the real models agree token for token in both modes."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvmemo import LLM, SamplingParams
from kvmemo.model.dense_attention import dense_causal_attention
from kvmemo.model.gguf import load_gguf
from kvmemo.model.llama import LlamaForCausalLM
from kvmemo.model.quant_linear import QuantizedWeight, native_kernel_available
from tests.model.test_gguf_reader import _tiny_llama_gguf
from tests.model.tiny import tiny_hf_model

pytestmark = pytest.mark.skipif(not native_kernel_available(), reason="no C compiler")
# One type per projection, so a file mixes them as llama.cpp's mixed quantizations do.
TYPES = {
    "attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q5_0, "attn_output": Q.Q4_1,
    "ffn_gate": Q.Q5_1, "ffn_up": Q.Q8_0, "ffn_down": Q.F16,
}


def _mixed_gguf(path) -> None:
    _tiny_llama_gguf(path, tiny_hf_model("llama"), {**TYPES, "token_embd": Q.BF16, "output": Q.Q8_0})


def test_mixed_type_gguf_native_equals_dense(tmp_path) -> None:
    path = tmp_path / "mixed.gguf"
    _mixed_gguf(path)
    dense = load_gguf(path)
    native = load_gguf(path, native=True)
    kinds = {type(v).__name__ for k, v in native.state_dict.items() if "proj" in k}
    assert kinds == {"QuantizedWeight"}
    assert isinstance(native.state_dict["model.embed_tokens.weight"], QuantizedWeight)
    config = dense.arch_config
    models = [LlamaForCausalLM.from_state_dict(config, c.state_dict) for c in (dense, native)]
    assert models[1].native_parts and not models[0].native_parts
    assert models[1].weight_bytes() < models[0].weight_bytes() / 2
    attention = dense_causal_attention(config.num_attention_heads, config.num_key_value_heads)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    for rows in (ids[:20], ids):  # 20 rows: the quantized kernel; 40: dequantize + GEMM
        logits = [m.compute_logits(m(rows, torch.arange(len(rows)), attention)) for m in models]
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    sequences = []
    for model in models:
        seq = ids[:6].tolist()
        for _ in range(10):
            x = torch.tensor(seq)
            seq.append(int(model.compute_logits(model(x, torch.arange(len(x)), attention)[-1:]).argmax()))
        sequences.append(seq)
    assert sequences[0] == sequences[1]


def test_native_needs_a_gguf(tmp_path) -> None:
    with pytest.raises(ValueError, match="weights='native'.*HF directory"):
        LLM(str(tmp_path), weights="native")


@pytest.mark.model
def test_bundled_model_native_equals_dense_greedy() -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = []
    for weights in ("dense", "native"):
        llm = LLM(weights=weights, num_blocks=256)
        outs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
    assert llm.memory_stats().weights_bytes < 150 * 2**20  # Q4_1 + Q8_0 bytes, not fp32's 650 MB


@pytest.mark.model
def test_gemma3_native_equals_dense_greedy(gemma3_gguf) -> None:
    """Q5_0, Q8_0, Q4_K and Q6_K tensors read in place."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = []
    for weights in ("dense", "native"):
        llm = LLM(str(gemma3_gguf), weights=weights, kv_cache_memory="256MiB")
        (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
        outs.append(list(out.outputs[0].token_ids))
        del llm
    assert outs[0] == outs[1]
