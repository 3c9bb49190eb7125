"""Temperature-only sampling through the C kernel (engine/kernels/sampling.py) against the torch
path it replaces (softmax, cumsum, search for the same uniform), and the Sampler with the kernel
on and off: the same tokens, the same random draws, unusable rows kept at their argmax."""

from __future__ import annotations

import pytest
import torch

import kvmemo.engine.sampler as sampler_module
from kvmemo import SamplingParams
from kvmemo.engine.kernels.sampling import _kernel, sample_rows
from kvmemo.engine.sampler import Sampler, _inverse_cdf

needs_kernel = pytest.mark.skipif(_kernel() is None, reason="no C compiler for the kernel")


def _torch_tokens(logits: torch.Tensor, temperatures: list[float], uniforms: list[float]):
    probs = torch.softmax(logits / torch.tensor(temperatures)[:, None], dim=-1)
    return _inverse_cdf(probs, torch.tensor(uniforms)).tolist()


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 300, 49152])  # 300: a tail past the 256-token blocks
@pytest.mark.parametrize("temperature", [1.0, 0.4, 2.5])
def test_tokens_are_the_inverse_cdf_to_rounding(vocab: int, temperature: float) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(40, vocab, generator=gen) * 4
    uniforms = torch.rand(40, generator=gen).tolist()
    got = sample_rows(logits, [temperature] * 40, uniforms)
    assert got is not None
    # float64 reference: token j is right when the target lies in [cdf[j-1], cdf[j]] widened by
    # the fp32 rounding of a running sum over the vocabulary (both fp32 paths sum differently)
    cdf = torch.cumsum(torch.softmax(logits.double() / temperature, dim=-1), dim=-1)
    slack = 1e-5
    for row, (token, u) in enumerate(zip(got, uniforms)):
        below = float(cdf[row, token - 1]) if token else 0.0
        assert below - slack <= u <= float(cdf[row, token]) + slack, (row, token, u)
    if vocab <= 300:  # no boundary within rounding of a uniform here: the torch path's tokens
        assert got == _torch_tokens(logits, [temperature] * 40, uniforms)


@needs_kernel
def test_masked_tokens_are_never_drawn_and_the_ends_of_the_range_hold() -> None:
    logits = torch.full((3, 1000), float("-inf"))
    logits[:, 10] = 0.0
    logits[:, 700] = 0.0
    # u = 0: the first token with mass, not a masked one before it; u -> 1: the last with mass
    got = sample_rows(logits, [1.0] * 3, [0.0, 0.4999, 0.9999999])
    assert got == [10, 10, 700]


@needs_kernel
def test_a_row_without_usable_mass_returns_none() -> None:
    logits = torch.zeros(2, 64)
    logits[1, 3] = float("nan")
    assert sample_rows(logits, [1.0, 1.0], [0.5, 0.5]) is None


def test_calls_it_cannot_run_return_none() -> None:
    logits = torch.zeros(2, 64, dtype=torch.float64)
    assert sample_rows(logits, [1.0, 1.0], [0.5, 0.5]) is None


@needs_kernel
def test_sampler_tokens_and_draws_equal_with_the_kernel_on_and_off(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(3)
    # 50 tokens: no boundary within fp32 rounding of a uniform, so both paths agree exactly
    logits = torch.randn(6, 50, generator=gen) * 3
    logits[2] = float("nan")  # no usable mass: its argmax, and no draw from the shared generator
    params = [SamplingParams(temperature=t, max_tokens=8) for t in (1.0, 0.7, 1.0, 1.3, 1.0)]
    params.append(SamplingParams(temperature=0.9, seed=11, max_tokens=8))

    def run() -> list[int]:
        sampler = Sampler(seed=5, device="cpu")
        first = [s.token_id for s in sampler.sample(logits.clone(), params, [0] * 6)]
        second = [s.token_id for s in sampler.sample(logits.clone(), params, [1] * 6)]
        return first + second

    fused = run()
    monkeypatch.setattr(sampler_module, "can_sample_rows", lambda logits: False)
    unfused = run()  # the torch path
    declined: list[int] = []
    monkeypatch.setattr(sampler_module, "can_sample_rows", lambda logits: True)
    monkeypatch.setattr(sampler_module, "sample_rows", lambda *a: declined.append(1))
    after_decline = run()  # the kernel declines after the draws: the same draws through torch
    assert declined
    assert fused == unfused == after_decline
    assert fused[2] == 0  # nan_to_num(NaN -> -inf) everywhere: argmax is the first index


@needs_kernel
def test_a_seeded_rows_tokens_do_not_depend_on_its_neighbours(monkeypatch) -> None:
    """The kernel and torch's path may differ at a boundary within fp32 rounding, so a plain
    row takes the kernel whatever the rows beside it ask (here: a top-p neighbour)."""
    gen = torch.Generator().manual_seed(9)
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=64)
    rows_seen: list[int] = []
    real = sampler_module.sample_rows
    monkeypatch.setattr(sampler_module, "sample_rows",
                        lambda logits, *a: rows_seen.append(logits.shape[0]) or real(logits, *a))
    for step in range(40):
        logits = torch.randn(2, 49152, generator=gen)  # flat: boundaries near every uniform
        alone, beside_cut = (
            Sampler(seed=0, device="cpu").sample(
                logits.clone(), [seeded, neighbour], [step, step])[0].token_id
            for neighbour in (SamplingParams(temperature=1.0, max_tokens=64),
                              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=64))
        )
        assert alone == beside_cut, step
    assert rows_seen[:2] == [2, 1]  # both plain rows; then the plain row alone, the cut via torch


@needs_kernel
def test_a_zero_probability_token_is_never_drawn_at_the_top_of_the_range() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(200, 1000, generator=gen)
    logits[:, -100:] = float("-inf")  # the last 100 tokens are forbidden
    tokens = sample_rows(logits, [1.0] * 200, [1 - 2**-24] * 200)  # torch.rand's largest value
    assert tokens is not None and max(tokens) < 900


def test_a_row_that_overflows_at_its_temperature_keeps_its_argmax() -> None:
    logits = torch.zeros(2, 50)
    logits[0, 7] = 1e34  # finite, but 1e34 / 2e-5 is past fp32's range
    params = [SamplingParams(temperature=2e-5, max_tokens=4),
              SamplingParams(temperature=1.0, max_tokens=4)]  # the shared generator
    got = [t.token_id for t in Sampler(seed=0, device="cpu").sample(logits, params, [0, 0])]
    alone = Sampler(seed=0, device="cpu").sample(logits[1:], params[1:], [0])[0].token_id
    assert got == [7, alone]
