"""A dense model's forward with the small ops in C (models/llama_fast.py, kernels/layer_ops.py): each op equals its torch
arithmetic (fp32 to rounding, bf16 rounded once from fp32), whole decode steps and prefills
equal the layer-by-layer forward, and greedy tokens equal the HF reference model's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmemo.model.config import ModelArchConfig
from kvmemo.model.kernels import layer_ops
from kvmemo.model.kernels.layer_ops import add_rmsnorm, rope_, silu_mul
from kvmemo.model.layers.basic import apply_rotary
from kvmemo.model.models.dense_attention import dense_causal_attention
from kvmemo.model.models.llama import LlamaForCausalLM
from kvmemo.model.models.llama_fast import DenseForward, prepare
from tests.model.tiny import caching_attention, tiny_hf_model

pytestmark = pytest.mark.skipif(not layer_ops.kernel_available(), reason="no C compiler")
# bf16: one rounding of the fp32 result, which may land a bf16 ulp apart where the compiler fuses
# a multiply-add that torch rounds twice
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.bfloat16: dict(rtol=2**-7, atol=1e-6)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_addend", [True, False])
def test_add_rmsnorm_adds_in_place_then_norms(dtype, with_addend) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(5, 96) * 3
    # addend rows with a stride wider than the row (a view of a wider product)
    addend = torch.randn(5, 130).to(dtype)[:, :96] if with_addend else None
    weight = torch.randn(96)
    expected_hidden = hidden + (addend.float() if addend is not None else 0)
    expected = F.rms_norm(expected_hidden, (96,), weight, 1e-5)
    got = add_rmsnorm(hidden, addend, weight, 1e-5, dtype)
    torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=0)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.to(dtype).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_the_leading_heads(dtype) -> None:
    torch.manual_seed(1)
    tokens, heads, rotated, head_dim = 4, 5, 3, 16
    x = torch.randn(tokens, heads * head_dim + 7).to(dtype)  # 7 columns past the heads
    angles = torch.rand(tokens, head_dim // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    rows = x.float()[:, : rotated * head_dim].view(tokens, rotated, head_dim)
    expected = apply_rotary(rows, cos[:, None], sin[:, None]).reshape(tokens, -1)
    untouched = x[:, rotated * head_dim :].clone()
    rope_(x, cos, sin, rotated * head_dim, head_dim)
    torch.testing.assert_close(x[:, : rotated * head_dim].float(), expected.to(dtype).float(),
                               **TOLERANCE[dtype])
    assert torch.equal(x[:, rotated * head_dim :], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_rounds_once(dtype) -> None:
    torch.manual_seed(2)
    both = (torch.randn(6, 2 * 40) * 4).to(dtype)  # gate and up as halves of one product
    gate, up = both[:, :40], both[:, 40:]
    expected = (F.silu(gate.float()) * up.float()).to(dtype)
    got = silu_mul(gate, up)
    # bf16: one rounding of the fp32 product, so equal but for the last bit where exp differs
    atol = 1e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-5 if atol else 1e-2,
                               atol=atol)


def _tiny(kind: str, dtype: torch.dtype, bind: bool = True) -> LlamaForCausalLM:
    hf = tiny_hf_model(kind)
    config = ModelArchConfig.from_hf_config(hf.config.to_dict())
    model = LlamaForCausalLM.from_state_dict(config, hf.state_dict(), dtype=dtype)
    if bind:
        prepare(model)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 70])  # a short chunk on one thread; one split over threads
def test_a_step_equals_the_layer_forward(kind, dtype, rows) -> None:
    """A 20-token prefill, then `rows` new tokens of the same sequence: the C path (for both
    calls) against DecoderLayer.forward (for both)."""
    model = _tiny(kind, dtype)
    assert model.dense_forward is not None
    config = model.config
    total = 20 + rows
    ids = torch.randint(0, config.vocab_size, (total,), generator=torch.Generator().manual_seed(4))
    outputs = []
    step = model.dense_forward
    for use_c in (True, False):
        model.dense_forward = step if use_c else None
        attention, _ = caching_attention()
        model(ids[:20], torch.arange(20), attention)
        outputs.append(model.compute_logits(model(ids[20:], torch.arange(20, total), attention)))
    model.dense_forward = step
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    scale = float(outputs[1].abs().max())
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=tolerance * scale)


def test_greedy_tokens_equal_hf_through_the_c_path() -> None:
    """fp32: greedy decoding one token per step (every step on the C path) gives HF's tokens."""
    hf = tiny_hf_model("llama")
    model = _tiny("llama", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(5))
    attention, _ = caching_attention()
    hidden = model(ids, torch.arange(9), attention)
    tokens = [int(model.compute_logits(hidden[-1:]).argmax())]
    for step in range(11):
        position = torch.tensor([9 + step])
        tokens.append(int(model.compute_logits(model(torch.tensor(tokens[-1:]), position,
                                                     attention)).argmax()))
    with torch.no_grad():
        reference = hf.generate(ids[None], max_new_tokens=12, do_sample=False)[0, 9:].tolist()
    assert tokens == reference


def test_the_c_path_takes_plain_llama_layers_in_fp32_or_bf16_only() -> None:
    model = _tiny("llama", torch.float32)
    assert DenseForward.fits(model)
    model.layers[0].mlp.activation = "gelu_pytorch_tanh"  # not SiLU: torch's path
    assert not DenseForward.fits(model)
    model.layers[0].mlp.activation = "silu"
    model = _tiny("llama", torch.float16, bind=False)  # no fp16 in layer_ops.c
    assert not DenseForward.fits(model)


def test_the_embeddings_given_are_not_modified() -> None:
    """inputs_embeds (a multimodal prompt's) is the caller's: the residual stream is a copy."""
    model = _tiny("llama", torch.float32)
    config = model.config
    attention = dense_causal_attention(config.num_attention_heads, config.num_key_value_heads)
    embeds = torch.randn(5, config.hidden_size)
    before = embeds.clone()
    model(torch.zeros(5, dtype=torch.long), torch.arange(5), attention, inputs_embeds=embeds)
    assert torch.equal(embeds, before)
