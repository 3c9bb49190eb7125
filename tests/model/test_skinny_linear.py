"""The few-row GEMM (kernels/skinny_linear.c) on packed weights equals F.linear in fp32 and bf16,
in every instruction-set path it has, and hands every input it cannot serve to F.linear."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from kvmemo.model.kernels import skinny_linear
from kvmemo.model.kernels.skinny_linear import MAX_ROWS, linear, pack, unpack
from kvmemo.native import load_library

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=1e-2, atol=2e-2)}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts kernel calls as (M, N, K, dtype code); skips where no C compiler builds it."""
    library = skinny_linear._library()
    if library is None:
        pytest.skip("no C compiler here: the few-row linear kernel cannot be built")
    calls = []

    class Counting:
        kvmemo_skinny_panel_cols = library.kvmemo_skinny_panel_cols

        @staticmethod
        def kvmemo_skinny_linear(*args):
            calls.append(args[6:])
            return library.kvmemo_skinny_linear(*args)

    monkeypatch.setattr(skinny_linear, "_library", lambda: Counting)
    return calls


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 products of the same (rounded) inputs."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 25, 32, MAX_ROWS])  # whole and partial row tiles
@pytest.mark.parametrize(
    # panel tails (N not a multiple of 32 or 16), odd K (bf16's pair tail), K = 1, many panels
    "out_features,in_features", [(7, 576), (1000, 40), (1536, 576), (9, 1), (64, 1537), (33, 3)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_f_linear(kernel_calls, dtype, rows, out_features, in_features, with_bias):
    torch.manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features).to(dtype)
    weight = torch.randn(out_features, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype) if with_bias else None
    got = linear(x, pack(weight, bias))
    code = skinny_linear.DTYPE_CODES[dtype]
    assert kernel_calls == [(rows, out_features, in_features, code)]  # the kernel ran
    assert got.dtype == dtype and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float(), reference(x, weight, bias), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_round_trips_exactly(kernel_calls, dtype):
    weight = torch.randn(77, 131).to(dtype)
    packed = pack(weight)
    assert torch.equal(unpack(packed), weight)
    assert packed.nbytes >= weight.numel() * weight.element_size()  # padded to whole panels


def test_bf16_rounds_once_from_fp32_sums(kernel_calls):
    """Each bf16 output is its fp32 sum rounded once (not a bf16 running sum): a sum of many
    small products lands within half a bf16 ulp of the exact value."""
    k = 4096
    x = torch.full((2, k), 1.0 + 2**-7, dtype=torch.bfloat16)
    weight = torch.full((3, k), 2**-7, dtype=torch.bfloat16)
    got = linear(x, pack(weight))
    exact = k * (1.0 + 2**-7) * 2**-7  # 32.25, exactly representable sums in fp32
    assert torch.equal(got.float(), torch.full((2, 3), exact).bfloat16().float())


@pytest.mark.parametrize("rows", [1, 13, 32, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_products_with_fp32_output(kernel_calls, rows, with_bias):
    """out_dtype=fp32 keeps the fp32 sums of the bf16 products: equal to fp32 F.linear of the
    same bf16 values to fp32 summation order, far inside one bf16 rounding of the output."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 577).bfloat16()  # odd K: the pair tail
    weight = torch.randn(1000, 577).bfloat16()
    bias = torch.randn(1000) if with_bias else None
    got = linear(x, pack(weight, bias), out_dtype=torch.float32)
    assert kernel_calls == [(rows, 1000, 577, skinny_linear.BF16_IN_FP32_OUT)]
    assert got.dtype == torch.float32
    want = reference(x, weight, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    rounded = linear(x, pack(weight, bias)).float()  # the bf16 output rounds: visibly further
    assert (got - want).abs().max() < (rounded - want).abs().max() / 20


def test_fp32_output_needs_bf16_input(kernel_calls):
    with pytest.raises(ValueError, match="fp32 for bf16 x"):
        linear(torch.randn(2, 8), pack(torch.randn(4, 8)), out_dtype=torch.bfloat16)


def test_strided_rows_and_weight_views(kernel_calls):
    """The MLP's gate/up halves are row views of one weight; x may arrive with a row stride."""
    weight = torch.randn(2 * 48, 64)
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]  # rows 100 apart, unit column stride: read in place
    for half in (weight[:48], weight[48:]):
        torch.testing.assert_close(linear(x, pack(half)), F.linear(x, half), rtol=1e-5, atol=1e-4)
    assert len(kernel_calls) == 2
    transposed = torch.randn(64, 5).t()  # column stride 64: copied first
    torch.testing.assert_close(linear(transposed, pack(weight)), F.linear(transposed, weight),
                               rtol=1e-5, atol=1e-4)


def test_rows_past_the_decode_class_run_the_kernel_too(kernel_calls):
    """The head's rare large products (prompt logprobs) run the kernel at any row count."""
    x, weight = torch.randn(MAX_ROWS + 45, 70), torch.randn(33, 70)
    torch.testing.assert_close(linear(x, pack(weight)), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert kernel_calls == [(MAX_ROWS + 45, 33, 70, 0)]


@pytest.mark.parametrize("case", ["other dtype", "wrong K", "autograd"])
def test_other_inputs_go_to_f_linear(kernel_calls, case):
    x, weight = torch.randn(4, 32), torch.randn(16, 32)
    packed = pack(weight)
    if case == "other dtype":
        x = x.bfloat16()
    elif case == "wrong K":
        with pytest.raises(RuntimeError):  # F.linear's error, not a read past the weight
            linear(torch.randn(2, 16), packed)
        assert kernel_calls == []
        return
    elif case == "autograd":
        x.requires_grad_(True)
    if case == "other dtype":
        with pytest.raises(RuntimeError):  # F.linear refuses mixed dtypes too
            linear(x, packed)
    else:
        torch.testing.assert_close(linear(x, packed), F.linear(x, weight))
    assert kernel_calls == []


def test_pack_rejects_what_it_cannot_pack(kernel_calls):
    with pytest.raises(ValueError, match="fp32 or bf16"):
        pack(torch.randn(4, 4).half())
    with pytest.raises(ValueError, match="fp32 or bf16"):
        pack(torch.randn(4))


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_narrower_instruction_sets_compute_the_same(march, dtype):
    """The AVX2 and plain-C builds (panels of 16 and 8 columns, bf16 by widening) are right too;
    this CPU's own build is the one the other tests ran."""
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("needs an x86-64 CPU with AVX2 to run these builds")
    library = load_library(skinny_linear.SOURCE, "test", march=march)
    if library is None:
        pytest.skip("no C compiler here")
    library.kvmemo_skinny_panel_cols.restype = ctypes.c_int
    cols = library.kvmemo_skinny_panel_cols()
    assert cols == {"x86-64-v3": 16, "x86-64": 8}[march]
    torch.manual_seed(cols)
    rows, n, k = 13, 3 * cols + 5, 75
    x, weight, bias = (torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype),
                       torch.randn(n).to(dtype))
    pair = 2 if dtype == torch.bfloat16 else 1
    steps = -(-k // pair)
    panels = F.pad(weight, (0, steps * pair - k, 0, -(-n // cols) * cols - n))
    panels = panels.reshape(-1, cols, steps, pair).permute(0, 2, 1, 3).contiguous()
    bias32 = bias.float()
    out = torch.empty(rows, n, dtype=dtype)
    library.kvmemo_skinny_linear.restype = None
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    library.kvmemo_skinny_linear.argtypes = [P, I64, P, P, P, I64, I64, I64, I64, ctypes.c_int]
    library.kvmemo_skinny_linear(x.data_ptr(), k, panels.data_ptr(), bias32.data_ptr(),
                                 out.data_ptr(), n, rows, n, k, skinny_linear.DTYPE_CODES[dtype])
    torch.testing.assert_close(out.float(), reference(x, weight, bias), **TOLERANCE[dtype])
