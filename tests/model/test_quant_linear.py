"""The quantized-weight kernel against gguf-py: rows equal gguf.quants.dequantize exactly, and
products equal dequantize followed by F.linear within fp32 rounding, for every type it reads,
over shapes with row tails and K not a multiple of the vector width."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvmemo.model.kernels.quant_linear import (
    NATIVE_TYPES,
    QuantizedWeight,
    dequantize_rows_into,
    native_kernel_available,
    quant_linear,
)
from kvmemo.model.loading.gguf import dequantize_tensor

pytestmark = pytest.mark.skipif(not native_kernel_available(), reason="no C compiler")
T = GGMLQuantizationType
# Types gguf-py can quantize; the K-quants it only dequantizes, so their blocks are built by hand.
QUANTIZABLE = {T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}


def random_blocks(qtype: GGMLQuantizationType, num_rows: int, num_cols: int, seed: int) -> np.ndarray:
    """[num_rows, row_bytes] of a random weight in `qtype`: quantized by gguf-py where it can,
    else random codes under fp16 scales of a sane size written at the type's scale offsets."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        weight = rng.standard_normal((num_rows, num_cols)).astype(np.float32)
        return quantize(weight, qtype)
    values, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (num_rows * num_cols // values, size), dtype=np.uint8)
    scale_offsets = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]
    for offset in scale_offsets:  # finite, modest fp16 scales (random bytes could be inf/nan)
        scales = (rng.random(len(blocks)) * 0.02 + 0.001).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(num_rows, -1)


def types() -> list[GGMLQuantizationType]:
    return sorted(NATIVE_TYPES, key=lambda t: t.name)


@pytest.mark.parametrize("qtype", types(), ids=lambda t: t.name)
def test_rows_equal_gguf_dequantize(qtype: GGMLQuantizationType) -> None:
    values, _ = GGML_QUANT_SIZES[qtype]
    num_cols = 3 * max(values, 32)
    raw = random_blocks(qtype, 7, num_cols, seed=1)
    weight = QuantizedWeight.from_numpy("w", qtype, raw)
    expected = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    assert weight.shape == (7, num_cols)
    assert torch.equal(weight.dequantize(), expected)
    ids = torch.tensor([6, 0, 3, 3])
    assert torch.equal(weight.rows(ids), expected[ids])


@pytest.mark.parametrize("qtype", types(), ids=lambda t: t.name)
def test_the_loaders_dequantize_equals_gguf_py(qtype: GGMLQuantizationType) -> None:
    """The dense mode's load (model/loading/gguf.py) dequantizes by this kernel: bit for bit
    gguf-py's values, for a 3-d tensor too (its rows are the leading dimensions' product)."""
    values, _ = GGML_QUANT_SIZES[qtype]
    num_cols = 2 * max(values, 32)
    raw = random_blocks(qtype, 6, num_cols, seed=3).view(np.uint8).reshape(2, 3, -1)  # file bytes
    got = dequantize_tensor("w", raw, qtype)
    assert got.shape == (2, 3, num_cols)
    assert torch.equal(got, torch.from_numpy(dequantize(raw, qtype).astype(np.float32)))
    assert dequantize_rows_into(raw, qtype, torch.empty_like(got))  # the kernel's path, not NumPy
    with pytest.raises(ValueError, match="do not fill an output"):
        dequantize_rows_into(raw, qtype, torch.empty(2, 3, num_cols + values))
    if values > 1:  # a row that ends inside a block: its bytes hold whole blocks only
        with pytest.raises(ValueError, match="do not fill an output"):
            dequantize_rows_into(raw, qtype, torch.empty(2, 3, num_cols + 1))


@pytest.mark.parametrize("qtype", types(), ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 3, 32, 33])
def test_products_equal_dequantize_then_linear(qtype: GGMLQuantizationType, num_rows: int) -> None:
    values, _ = GGML_QUANT_SIZES[qtype]
    for num_out, num_cols in ((13, 3 * max(values, 32)), (64, 5 * max(values, 32) + values)):
        if num_cols % values:
            continue
        raw = random_blocks(qtype, num_out, num_cols, seed=num_rows + num_out)
        weight = QuantizedWeight.from_numpy("w", qtype, raw)
        x = torch.randn(num_rows, num_cols, generator=torch.Generator().manual_seed(num_out))
        expected = F.linear(x, torch.from_numpy(dequantize(raw, qtype).astype(np.float32)))
        got = quant_linear(x, weight)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_writes_into_a_column_slice_of_a_fused_output() -> None:
    raw_a = random_blocks(T.Q4_0, 10, 64, seed=3)
    raw_b = random_blocks(T.Q8_0, 6, 64, seed=4)
    x = torch.randn(4, 64)
    out = torch.full((4, 16), float("nan"))
    quant_linear(x, QuantizedWeight.from_numpy("a", T.Q4_0, raw_a), out[:, :10])
    quant_linear(x, QuantizedWeight.from_numpy("b", T.Q8_0, raw_b), out[:, 10:])
    dense = np.concatenate([dequantize(raw_a, T.Q4_0), dequantize(raw_b, T.Q8_0)])
    torch.testing.assert_close(out, F.linear(x, torch.from_numpy(dense.astype(np.float32))))


def test_unsupported_type_and_bad_shapes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight'.*IQ2_XXS.*supported: BF16"):
        QuantizedWeight("blk.0.attn_q.weight", T.IQ2_XXS, torch.zeros(1, 66, dtype=torch.uint8), 256)
    weight = QuantizedWeight.from_numpy("w", T.Q8_0, random_blocks(T.Q8_0, 2, 64, seed=0))
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        quant_linear(torch.zeros(1, 32), weight)
    with pytest.raises(IndexError, match="outside"):
        weight.rows(torch.tensor([2]))
