"""weights="native": a GGUF's linear weights stay at their own bits (mixed types in one file,
llama's permuted q/k rows included) and the model computes what the dequantized ("dense") one
does: exactly on prefill-sized batches (dequantize + GEMM), and within the int8 rounding of the
activations on decode-sized ones (quant_int8.py), where the first greedy tokens agree and the
teacher-forced next tokens agree almost everywhere on the real models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvmemo import LLM, SamplingParams
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.model.kernels.quant_int8 import activation_group, quantize_activations
from kvmemo.model.kernels.quant_linear import QuantizedWeight, native_kernel_available
from kvmemo.model.layers.native_linear import NativeLinear
from kvmemo.model.loading.gguf import load_gguf
from kvmemo.model.models.dense_attention import dense_causal_attention
from kvmemo.model.models.llama import LlamaForCausalLM
from kvmemo.model.models.llama_fast import prepare
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
    # every row count takes the kernels: activations rounded to int8 per 4 values
    logits = [m.compute_logits(m(ids, torch.arange(40), attention)) for m in models]
    scale = float(logits[0].abs().max())
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0.02 * scale)
    assert bool((logits[1][:20].argmax(-1) == logits[0][:20].argmax(-1)).all())
    for start in (0, 10, 25):  # a few prompts: the first greedy tokens agree
        prompt = ids[start : start + 6]
        assert _greedy(models[0], prompt, attention) == _greedy(models[1], prompt, attention)


def _greedy(model: LlamaForCausalLM, prompt: torch.Tensor, attention, steps: int = 4) -> list[int]:
    seq = prompt.tolist()
    for _ in range(steps):
        x = torch.tensor(seq)
        seq.append(int(model.compute_logits(model(x, torch.arange(len(x)), attention)[-1:]).argmax()))
    return seq


def test_fused_decode_step_computes_the_layer() -> None:
    """A file whose projections are all int8-kernel types takes the fused decode step
    (models/llama_fast.py): the same logits as the layer's own forward over the same kernels, and
    within the int8 rounding of the dense model's."""
    path_types = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q5_1, "attn_output": Q.Q4_1,
                  "ffn_gate": Q.Q5_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fused.gguf"
        _tiny_llama_gguf(path, tiny_hf_model("llama"), {**path_types, "output": Q.Q8_0})
        dense, native = load_gguf(path), load_gguf(path, native=True)
    config = dense.arch_config
    models = [LlamaForCausalLM.from_state_dict(config, c.state_dict) for c in (dense, native)]
    prepare(models[1])
    layers = list(models[1].layers)
    assert all(layer.fused_step is not None for layer in layers)
    attention = dense_causal_attention(config.num_attention_heads, config.num_key_value_heads)
    ids = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12)
    fused = models[1].compute_logits(models[1](ids, positions, attention))
    steps = [layer.fused_step for layer in layers]
    for layer in layers:
        layer.fused_step = None
    unfused = models[1].compute_logits(models[1](ids, positions, attention))
    for layer, step in zip(layers, steps):
        layer.fused_step = step
    # the same kernels; only the norm / RoPE / SiLU float order differs (a code may round apart)
    torch.testing.assert_close(fused, unfused, rtol=0, atol=2e-3 * float(unfused.abs().max()))
    reference = models[0].compute_logits(models[0](ids, positions, attention))
    torch.testing.assert_close(fused, reference, rtol=0, atol=0.02 * float(reference.abs().max()))


def test_native_needs_a_gguf(tmp_path) -> None:
    with pytest.raises(ValueError, match="weights='native'.*HF directory"):
        LLM(str(tmp_path), weights="native")


@torch.inference_mode()
def _teacher_forced(llm: LLM, prompt: list[int], continuation: list[int]) -> list[int]:
    """The model's argmax after each token of prompt + continuation[:-1] past the prompt, fed one
    token per step through the engine's paged cache (the decode path: kernels, fused KV write),
    on the engine's device."""
    runner = llm.engine.runner
    cache, backend, device = runner.kv_cache, runner.attention_backend, runner.device
    ids = prompt + continuation[:-1]
    table = list(range(-(-len(ids) // cache.block_size)))
    predicted = []
    for position, token in enumerate(ids):
        metadata = AttentionMetadata.build(
            block_tables=[table], num_computed_tokens=[position], query_lens=[1],
            block_size=cache.block_size, num_cache_blocks=cache.num_blocks, device=device)
        hidden = runner.model(torch.tensor([token], device=device),
                              torch.tensor([position], device=device),
                              lambda layer, q, k, v: backend.forward(layer, q, k, v, cache, metadata))
        if position >= len(prompt) - 1:
            predicted.append(int(runner.model.compute_logits(hidden).argmax()))
    return predicted


@pytest.mark.model
def test_bundled_model_native_agrees_with_dense() -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    dense = LLM(weights="dense", num_blocks=256, enable_prefix_caching=False)
    reference = [list(o.outputs[0].token_ids) for o in dense.generate(prompts, params, use_tqdm=False)]
    del dense
    # the weights held are the GGUF's bits alone
    llm = LLM(weights="native", num_blocks=256, enable_prefix_caching=False)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o[:4] for o in outs] == [r[:4] for r in reference]
    encoded = [llm.engine.processor.encode_prompt(p) for p in prompts]
    same = sum(a == b for ids, ref in zip(encoded, reference)
               for a, b in zip(_teacher_forced(llm, ids, ref), ref))
    assert same / sum(map(len, reference)) >= 0.9  # 96 positions; measured figures: docs
    assert llm.memory_stats().weights_bytes < 150 * 2**20  # Q4_1 + Q8_0 bytes, not fp32's 650 MB


@pytest.mark.model
def test_gemma3_native_agrees_with_dense_greedy(gemma3_gguf) -> None:
    """Q5_0, Q8_0, Q4_K and Q6_K tensors read in place."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = []
    for weights in ("dense", "native"):
        llm = LLM(str(gemma3_gguf), weights=weights, kv_cache_memory="256MiB")
        (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
        outs.append(list(out.outputs[0].token_ids))
        del llm
    assert outs[0][:4] == outs[1][:4]


@pytest.mark.model
def test_gemma3_fused_step_computes_the_layer(gemma3_gguf) -> None:
    """Gemma 3's native layers take the fused two-call step (llama_fast.GemmaFusedLayerStep,
    its four norms, per-head norms and GELU folded in): the same logits as the layer's own
    forward over the same kernels, up to the float order of those small ops."""
    from kvmemo.model.models.llama_fast import GemmaFusedLayerStep

    llm = LLM(str(gemma3_gguf), weights="native", kv_cache_memory="64MiB")
    model = llm.engine.runner.model
    layers = list(model.layers)
    assert all(isinstance(layer.fused_step, GemmaFusedLayerStep) for layer in layers)
    config = model.config
    attention = dense_causal_attention(config.num_attention_heads, config.num_key_value_heads,
                                       config.attention_scale)
    ids = torch.tensor(llm.engine.processor.encode_prompt("The capital of France is Paris. The"))
    positions = torch.arange(len(ids))
    with torch.inference_mode():
        fused = model.compute_logits(model(ids, positions, attention))
        steps = [layer.fused_step for layer in layers]
        for layer in layers:
            layer.fused_step = None
        try:
            unfused = model.compute_logits(model(ids, positions, attention))
        finally:
            for layer, step in zip(layers, steps):
                layer.fused_step = step
    # Each layer's output moves a little (an int8 code may round the other way, and a code's
    # step is its group of 16 values' amax / 127), and Gemma's residual stream (entries in the
    # thousands) carries that through 18 layers: up to 2.6% of the largest logit here (0.8-1.4%
    # with a scale per 4 values); wiring a norm wrong moves them by tens of percent.
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0.04 * float(unfused.abs().max()))
    assert torch.equal(fused.argmax(-1), unfused.argmax(-1))


def test_native_rows_do_not_depend_on_the_rows_beside_them() -> None:
    """Batch invariance: a row's product is the same bits in a call of 1 row, 5, 37 or 300 (past
    the kernel's tile of 4 and its pass of x rows), and within the int8 bound of x @ W^T."""
    from tests.model.test_quant_linear import random_blocks

    parts: list[QuantizedWeight | torch.Tensor] = [
        QuantizedWeight.from_numpy(f"w{i}", qtype, random_blocks(qtype, rows, 256, seed=i))
        for i, (qtype, rows) in enumerate([(Q.Q4_1, 40), (Q.Q8_0, 24), (Q.Q6_K, 16), (Q.F16, 8)])
    ]
    linear = NativeLinear(parts, None)
    dense = linear.dense()
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(0))
    whole = linear(x)
    for rows in (1, 5, 37):
        for start in (0, 3, 250):
            assert torch.equal(linear(x[start:start + rows]), whole[start:start + rows])
    quantized = dense[:80]  # the int8 kernel's columns: within half an int8 code per value
    _, scales = quantize_activations(x)
    bound = (scales.repeat_interleave(activation_group(), dim=1) / 2) @ quantized.abs().T
    assert bool(((whole[:, :80] - x @ quantized.T).abs() <= bound * 1.001 + 1e-4).all())
    f16 = dense[80:].double()  # F16: fp32 activations, fp32 sums in the kernel's order
    error = (whole[:, 80:].double() - x.double() @ f16.T).abs()
    assert bool((error <= 1e-6 * (x.double().abs() @ f16.abs().T) + 1e-6).all())


def test_auto_weights_are_native_for_a_gguf_on_cpu(tmp_path, monkeypatch) -> None:
    from kvmemo.model.loading.loader import bundled_model_path, resolve_weights_mode

    gguf = Path(bundled_model_path())
    monkeypatch.delenv("KVMEMO_WEIGHTS", raising=False)
    assert resolve_weights_mode("auto", gguf, "cpu") == "native"
    assert resolve_weights_mode("auto", gguf, "cuda") == "dense"  # the kernels are CPU code
    assert resolve_weights_mode("auto", tmp_path, "cpu") == "dense"  # an HF directory
    assert resolve_weights_mode("dense", gguf, "cpu") == "dense"
    monkeypatch.setenv("KVMEMO_WEIGHTS", "dense")
    assert resolve_weights_mode("auto", gguf, "cpu") == "dense"
    monkeypatch.setenv("KVMEMO_WEIGHTS", "fp4")
    with pytest.raises(ValueError, match="KVMEMO_WEIGHTS='fp4'; allowed: dense, native"):
        resolve_weights_mode("auto", gguf, "cpu")


@pytest.mark.parametrize("native", [False, True], ids=["dense", "native"])
def test_a_truncated_gguf_names_the_tensor_cut_off(tmp_path, native: bool) -> None:
    from kvmemo.model.loading.loader import bundled_model_path

    data = Path(bundled_model_path()).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1_000_000])  # the last tensors' bytes are missing
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.\d+\.\w+\.weight' runs past the end"):
        load_gguf(cut, native=native)


def test_a_type_the_kernels_do_not_read_loads_dense_in_native_mode(tmp_path, monkeypatch) -> None:
    import kvmemo.model.loading.gguf as gguf_module

    path = tmp_path / "mixed.gguf"
    _mixed_gguf(path)
    monkeypatch.setattr(gguf_module, "NATIVE_TYPES", gguf_module.NATIVE_TYPES - {Q.Q5_0})
    native = load_gguf(path, native=True)
    v_proj = [v for k, v in native.state_dict.items() if k.endswith("v_proj.weight")]
    assert v_proj and all(isinstance(v, torch.Tensor) for v in v_proj)  # Q5_0 (attn_v): dense
    assert isinstance(native.state_dict["model.layers.0.self_attn.q_proj.weight"], QuantizedWeight)
    config = native.arch_config
    model = LlamaForCausalLM.from_state_dict(config, native.state_dict)
    dense = LlamaForCausalLM.from_state_dict(config, load_gguf(path).state_dict)
    attention = dense_causal_attention(config.num_attention_heads, config.num_key_value_heads)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    got = model.compute_logits(model(ids, torch.arange(40), attention))
    expected = dense.compute_logits(dense(ids, torch.arange(40), attention))
    # within the int8 rounding of the other projections' activations
    torch.testing.assert_close(got, expected, rtol=0, atol=0.02 * float(expected.abs().max()))


@pytest.mark.model
def test_native_and_dense_kv_never_share_a_namespace() -> None:
    roots = {LLM(weights=w, num_blocks=64).engine.kv_info().namespace_root
             for w in ("dense", "native")}
    assert len(roots) == 2  # a shared disk/Redis store keeps the modes' blocks apart
