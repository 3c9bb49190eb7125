"""linear(): the few-row CPU kernel equals F.linear, and only takes the inputs it can serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmemo.model import skinny_linear
from kvmemo.model.skinny_linear import MAX_ROWS, linear


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts kernel calls; skips where no C compiler can build it."""
    kernel = skinny_linear._kernel()
    if kernel is None:
        pytest.skip("no C compiler here: the few-row linear kernel cannot be built")
    calls = []

    def counting(*args):
        calls.append(args[3:])  # (M, N, K)
        return kernel(*args)

    monkeypatch.setattr(skinny_linear, "_kernel", lambda: counting)
    return calls


@pytest.mark.parametrize("rows", [1, 3, 8, MAX_ROWS])
@pytest.mark.parametrize(
    "out_features,in_features", [(7, 576), (1000, 40), (1536, 576), (9, 1), (64, 1536)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_f_linear(kernel_calls, rows, out_features, in_features, with_bias):
    torch.manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    got = linear(x, weight, bias)
    assert kernel_calls == [(rows, out_features, in_features)]  # the kernel, not F.linear, ran
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_weight_row_views_and_strided_inputs(kernel_calls):
    """The MLP's gate/up halves are row views of one weight; x may arrive non-contiguous."""
    weight = torch.randn(2 * 48, 64)
    x = torch.randn(64, 5).t()  # [5, 64], not contiguous
    for half in (weight[:48], weight[48:]):
        torch.testing.assert_close(linear(x, half), F.linear(x, half), rtol=1e-5, atol=1e-4)
    assert len(kernel_calls) == 2


@pytest.mark.parametrize(
    "case",
    ["too many rows", "bf16", "non-contiguous weight", "3-D input", "autograd"],
)
def test_other_inputs_go_to_f_linear(kernel_calls, case):
    x, weight = torch.randn(4, 32), torch.randn(16, 32)
    if case == "too many rows":
        x = torch.randn(MAX_ROWS + 1, 32)
    elif case == "bf16":
        x, weight = x.bfloat16(), weight.bfloat16()
    elif case == "non-contiguous weight":
        weight = torch.randn(32, 16).t()
    elif case == "3-D input":
        x = torch.randn(2, 4, 32)
    elif case == "autograd":
        weight.requires_grad_(True)
    got = linear(x, weight)
    assert kernel_calls == []
    torch.testing.assert_close(got, F.linear(x, weight))


def test_without_a_kernel_it_is_f_linear(monkeypatch):
    monkeypatch.setattr(skinny_linear, "_kernel", lambda: None)
    x, weight = torch.randn(2, 24), torch.randn(8, 24)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=0, atol=0)


def test_other_weight_shapes_are_f_linear_s_business(kernel_calls):
    """A wrong in_features must be F.linear's error, not the kernel reading past the weight; a
    1-D weight (which F.linear takes) gets F.linear's answer."""
    with pytest.raises(RuntimeError):
        linear(torch.randn(2, 32), torch.randn(8, 16))
    x, vector = torch.randn(2, 32), torch.randn(32)
    torch.testing.assert_close(linear(x, vector), F.linear(x, vector))
    assert kernel_calls == []
