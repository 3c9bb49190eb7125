"""The greedy head (model/greedy_head.py): the argmax of the fp32 logits from a bf16 product and
an fp32 check, against F.linear's fp32 argmax; its error bound against oneDNN's bf16 product;
and the bundled model's greedy tokens with the head on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmemo import LLM, SamplingParams
from kvmemo.model.layers.greedy_head import GreedyHead, relative_error_bound

needs_head = pytest.mark.skipif(
    not GreedyHead.available(torch.zeros(1, 1)),
    reason="the greedy head needs bf16 products (avx512_bf16 or AMX), oneDNN and a C compiler",
)


def _near_ties(vocab: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Weights whose rows come in groups of near copies: their logits differ by far less than
    bf16 resolves, so the bf16 maximum alone picks the wrong token often."""
    base = torch.randn(vocab // 8 + 1, dim, generator=gen) * 0.05
    rows = base.repeat_interleave(8, dim=0)[:vocab]
    return rows + torch.randn(vocab, dim, generator=gen) * 1e-4


@needs_head
@pytest.mark.parametrize("rows", [1, 7, 32, 33])
@pytest.mark.parametrize("vocab", [1000, 4099])  # 4,099: a tail past the 16-wide scan
def test_tokens_equal_the_fp32_argmax(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * 7919 + vocab)
    weight = _near_ties(vocab, 96, gen)
    hidden = torch.randn(rows, 96, generator=gen) * 3
    exact = F.linear(hidden, weight)
    coarse_pick = F.linear(hidden.bfloat16(), weight.bfloat16()).float().argmax(dim=-1)
    expected = exact.argmax(dim=-1)
    got = GreedyHead(weight)(hidden)
    assert got.dtype == torch.int64
    # near copies' logits differ by ~1e-3, far above fp32 summation-order differences
    assert torch.equal(got, expected)
    if rows >= 7:  # the data defeats the bf16 maximum alone: the check is what got it right
        assert (coarse_pick != expected).any()


@needs_head
def test_the_bound_holds_for_the_real_bf16_products() -> None:
    """The coarse product this machine runs (the few-row GEMM, in 32-row slices here, or
    oneDNN) stays within the bound."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(4096, 576, generator=gen) * 0.05
    hidden = torch.randn(64, 576, generator=gen) * 4
    head = GreedyHead(weight)
    coarse = head.coarse(hidden.bfloat16()).float()
    exact = F.linear(hidden.double(), weight.double())
    bound = relative_error_bound(576) * hidden.norm(dim=1)[:, None] * weight.norm(dim=1)[None]
    error = (coarse.double() - exact).abs()
    assert torch.all(error <= bound)
    assert error.max() > bound.max() / 1000  # the bound is not vacuous far off the errors


@needs_head
def test_roundings_that_all_push_one_way_do_not_fool_it() -> None:
    """x and w chosen so that bf16 rounds token 0's products down and token 1's up (ties to
    even at 1 + 2^-8 and 1 + 3 * 2^-8): the bf16 product ranks token 1 first by 6 logits,
    while fp32 ranks token 0 first."""
    first, second = 305, 300
    hidden = torch.empty(1, first + second)
    hidden[0, :first] = 1 + 2**-8
    hidden[0, first:] = 1 + 3 * 2**-8
    weight = torch.zeros(2, first + second)
    weight[0, :first] = 1 + 2**-8
    weight[1, first:] = 1 + 3 * 2**-8
    head = GreedyHead(weight)
    assert head.coarse(hidden.bfloat16()).float().argmax() == 1
    assert F.linear(hidden, weight).argmax() == 0
    assert head(hidden).tolist() == [0]


@needs_head
def test_a_non_finite_row_is_left_to_the_full_head() -> None:
    weight = torch.randn(300, 64)
    hidden = torch.randn(3, 64)
    hidden[1, 5] = float("inf")
    got = GreedyHead(weight)(hidden)
    assert got[1] == -1
    assert got[0] == F.linear(hidden[:1], weight).argmax() and got[2] >= 0


@needs_head
@pytest.mark.model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bundled_model_tokens_with_and_without_the_greedy_head(dtype: str) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(dtype=dtype, num_blocks=128, enable_prefix_caching=False)
    model = llm.engine.runner.model
    with_head = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert model.greedy_head is not None
    head, model.greedy_head = model.greedy_head, None
    try:
        without = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        model.greedy_head = head
    assert with_head == without


@needs_head
def test_bf16_logits_are_the_fp32_sums_of_the_bf16_products() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(4099, 576, generator=gen) * 0.05
    hidden = torch.randn(64, 576, generator=gen)
    got = GreedyHead(weight).bf16_logits(hidden)
    assert got.dtype == torch.float32 and got.shape == (64, 4099)
    want = F.linear(hidden.bfloat16().float(), weight.bfloat16().float())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_head
@pytest.mark.model
def test_sampled_rows_read_the_bf16_head_only_in_the_bf16_mode() -> None:
    """bf16 mode: sampling_logits is the bf16 product of the fp32 head weight (not the fp32
    head); the fp32 mode has no other head. (Which rows read it: test_sampling_head_rows.py.)"""
    hidden = torch.randn(3, 576, generator=torch.Generator().manual_seed(5))
    bf16 = LLM(dtype="bfloat16", num_blocks=64).engine.runner.model
    weight = bf16.lm_head.weight.detach()
    assert weight.dtype == torch.float32  # the head's weight stays fp32 in the bf16 mode
    want = F.linear(hidden.bfloat16().float(), weight.bfloat16().float())
    torch.testing.assert_close(bf16.sampling_logits(hidden), want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(bf16.sampling_logits(hidden), bf16.compute_logits(hidden))
    fp32 = LLM(dtype="float32", num_blocks=64).engine.runner.model
    assert torch.equal(fp32.sampling_logits(hidden), fp32.compute_logits(hidden))


@needs_head
@pytest.mark.model
def test_a_seeded_sample_does_not_depend_on_a_logprobs_neighbour() -> None:
    llm = LLM(dtype="bfloat16", num_blocks=128, enable_prefix_caching=False)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    neighbour = SamplingParams(max_tokens=16, temperature=1.0, logprobs=2, seed=1, ignore_eos=True)
    both = llm.generate(["Once upon a time", "The capital of France is"], [seeded, neighbour],
                        use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone
    assert both[1].outputs[0].logprobs  # the neighbour did ask for logprobs
