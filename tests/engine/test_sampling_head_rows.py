"""Which rows' logits come from the model's sampling head (the bf16 mode's bf16 product) and
which from its exact head, row by row in one batch (ModelRunner._logits, no model loaded)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvmemo.engine.model_runner import ModelRunner
from kvmemo.sampling import SamplingParams


class _Heads:
    """Exact logits are the hidden rows; sampling-head logits are them + 1000."""

    def __init__(self, has_sampling_head: bool = True) -> None:
        self.has_sampling_head = has_sampling_head
        self.calls: list[tuple[str, int]] = []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(("exact", hidden.shape[0]))
        return hidden.clone()

    def sampling_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(("sampling", hidden.shape[0]))
        return hidden + 1000


ROWS = [  # (sampling params, returns a logprobs row (beam search), reads the sampling head)
    (SamplingParams(temperature=0.0), False, False),  # greedy: the exact argmax
    (SamplingParams(temperature=1.0), False, True),
    (SamplingParams(temperature=0.7, logprobs=2), False, False),  # logprobs shown to the user
    (SamplingParams(temperature=1.0), True, False),  # a beam's log-probabilities
    (SamplingParams(temperature=1.0, top_k=1), False, False),  # a top-1 cut is greedy
    (SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2), False, True),
]


def _logits(model: _Heads, rows=ROWS, capture: bool = False) -> torch.Tensor:
    runner = SimpleNamespace(model=model, capture_logits=capture)
    seqs = [SimpleNamespace(sampling_params=p, return_logprobs_row=beam) for p, beam, _ in rows]
    hidden = torch.arange(len(rows) * 4, dtype=torch.float32).reshape(len(rows), 4)
    return ModelRunner._logits(runner, hidden, seqs) - hidden  # 1000 where the sampling head


def test_each_row_reads_its_own_head() -> None:
    model = _Heads()
    got = _logits(model)
    want = torch.tensor([1000.0 if sampling else 0.0 for *_, sampling in ROWS])
    assert torch.equal(got, want[:, None].expand(-1, 4))
    assert sorted(model.calls) == [("exact", 4), ("sampling", 2)]


def test_one_product_when_every_row_reads_one_head() -> None:
    sampled = [row for row in ROWS if row[2]]
    model = _Heads()
    assert torch.equal(_logits(model, sampled), torch.full((2, 4), 1000.0))
    assert model.calls == [("sampling", 2)]


def test_the_exact_head_alone_without_a_sampling_head_or_when_capturing() -> None:
    for model, capture in ((_Heads(has_sampling_head=False), False), (_Heads(), True)):
        assert torch.equal(_logits(model, capture=capture), torch.zeros(len(ROWS), 4))
        assert model.calls == [("exact", len(ROWS))]  # one product for the whole batch
