"""BeamSearch (the driver alone, over the pure-Python KV manager) against HF `generate()` on a tiny
random Llama: every stopping rule, length penalties of both signs, one or two EOS ids that end
beams early, and the block bookkeeping checked after every step. No GGUF needed, so it is fast."""

from __future__ import annotations

import pytest
import torch

from kvmemo.engine.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams
from tests.kv.kv_testing import admit, finish_step, make_manager, make_request
from tests.model.tiny import tiny_hf_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_hf_model("llama", seed=3)


def logprobs_of(model, sequences: list[list[int]]) -> torch.Tensor:
    """[len(sequences), vocab] log_softmax at each sequence's last position (no cache)."""
    with torch.inference_mode():
        rows = [model(input_ids=torch.tensor([ids])).logits[0, -1] for ids in sequences]
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def frequent_tokens(model, prompt: list[int], count: int) -> list[int]:
    """Tokens ranked 2nd, 3rd, ... after the prompt: made EOS, they end beams at once."""
    return torch.topk(logprobs_of(model, [prompt])[0], count + 1).indices[1:].tolist()


Beams = list[tuple[list[int], float]]


def run_kvmemo(model, prompt, params: BeamSearchParams, eos: list[int]) -> Beams:
    manager = make_manager(num_blocks=512, block_size=4)
    root = make_request("root", prompt)
    search = BeamSearch(root, params, manager, eos_token_ids=eos, max_new_tokens=params.max_tokens)
    admit(manager, root)
    finish_step(manager, root)  # the prompt's forward
    while not search.step(logprobs_of(model, [b.all_token_ids for b in search.beams or [root]])):
        manager.check_invariants()
        for beam in search.beams:  # the next forward: one new token per beam
            assert manager.allocate_slots(beam, 1) is not None
            beam.num_computed_tokens += 1
        manager.take_copies()
        manager.check_invariants()
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks
    return [(f.request.output_token_ids, f.score) for f in search.finished]


def run_hf(model, prompt, params: BeamSearchParams, eos: list[int]) -> Beams:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=params.beam_width,
            num_return_sequences=params.beam_width,
            do_sample=False,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=eos,
            pad_token_id=eos[0],
            return_dict_in_generate=True,
            output_scores=True,
        )
    if params.beam_width == 1:  # HF runs greedy search: no beam scores
        return [(out.sequences[0, len(prompt) :].tolist(), None)]
    beams = []
    for sequence, score, beam_indices in zip(out.sequences, out.sequences_scores, out.beam_indices):
        num_generated = int((beam_indices >= 0).sum())
        beams.append((sequence[len(prompt) : len(prompt) + num_generated].tolist(), float(score)))
    return beams


CASES = [
    # (prompt seed, beam_width, max_tokens, length_penalty, early_stopping, number of EOS ids)
    (0, 1, 6, 1.0, False, 1),  # greedy, as HF generate(num_beams=1)
    (12, 1, 8, 1.0, False, 0),
    (1, 2, 8, 1.0, False, 1),
    (2, 3, 9, 1.0, True, 1),
    (3, 4, 7, 1.0, "never", 1),
    (4, 3, 9, 2.0, "never", 1),
    (5, 3, 9, 2.0, False, 1),
    (6, 4, 8, 0.0, False, 2),
    (7, 3, 10, -1.0, False, 1),
    (8, 3, 10, -0.5, "never", 2),
    (9, 5, 6, 1.0, True, 2),
    (10, 2, 12, 0.7, False, 0),
    (11, 4, 10, 1.0, False, 1),
    # The heuristic stops before max_tokens; scoring the best running beam at max_tokens
    # (as "never" does) would go on and return other beams.
    (16, 3, 12, 1.0, False, 2),
    (16, 2, 12, 2.0, False, 2),
]


def case_inputs(model, seed: int, num_eos: int) -> tuple[list[int], list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 97, (3 + seed % 5,), generator=generator).tolist()
    # EOS ids the model likes end beams early; with none, the config's id 2 (rarely chosen).
    eos = frequent_tokens(model, prompt, 2)[:num_eos] if num_eos else [2]
    return prompt, eos


@pytest.mark.parametrize(
    ("seed", "width", "max_tokens", "length_penalty", "early_stopping", "num_eos"), CASES
)
def test_driver_matches_hf_generate(
    tiny, seed, width, max_tokens, length_penalty, early_stopping, num_eos
):
    prompt, eos = case_inputs(tiny, seed, num_eos)
    params = BeamSearchParams(width, max_tokens, length_penalty, early_stopping)
    got = run_kvmemo(tiny, prompt, params, eos)
    expected = run_hf(tiny, prompt, params, eos)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    if width > 1:
        expected_scores = [score for _, score in expected]
        assert [score for _, score in got] == pytest.approx(expected_scores, abs=1e-4)


def test_some_cases_end_beams_before_max_tokens(tiny):
    """The cases above really exercise EOS: HF itself returns beams shorter than max_tokens."""
    num_short = 0
    for seed, width, max_tokens, length_penalty, early_stopping, num_eos in CASES[:4]:
        prompt, eos = case_inputs(tiny, seed, num_eos)
        params = BeamSearchParams(width, max_tokens, length_penalty, early_stopping)
        beams = run_hf(tiny, prompt, params, eos)
        num_short += sum(len(tokens) < max_tokens for tokens, _ in beams)
    assert num_short > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("beam_width", 0),
        ("beam_width", MAX_BEAM_WIDTH + 1),
        ("beam_width", True),
        ("beam_width", 2.0),
        ("max_tokens", 0),
        ("max_tokens", "8"),
        ("length_penalty", float("nan")),
        ("length_penalty", float("inf")),
        ("length_penalty", "1"),
        ("length_penalty", True),
        ("early_stopping", "sometimes"),
        ("early_stopping", 1),
        ("early_stopping", None),
    ],
)
def test_bad_params_are_value_errors_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**{field: value})


def test_good_params():
    for early_stopping in (True, False, "never"):
        BeamSearchParams(
            beam_width=1, max_tokens=1, length_penalty=-2, early_stopping=early_stopping
        )
