"""RequestOutputKind through the engine's OutputProcessor, on a tiny random Llama: delta outputs
add up to the cumulative output's text, token ids and logprobs (held back where a stop string
may still cut, so a stream never sends text the final reply lacks), prompt logprobs come once,
and final-only gives one output."""

from __future__ import annotations

import pytest

from kvmemo.config import EngineConfig
from kvmemo.engine import Engine
from kvmemo.outputs import RequestOutput, RequestOutputKind
from kvmemo.sampling import SamplingParams
from tests.gpu.tiny_llama import save_tiny_llama

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
LETTERS = tuple(range(81, 100))  # "a".."s", one character each


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    directory = tmp_path_factory.mktemp("tiny_llama_kinds")
    save_tiny_llama(directory, vocab_size=512, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=4)
    return Engine(EngineConfig(model=str(directory), device="cpu", dtype="float32",
                               num_blocks=64))


def run(engine: Engine, kind: RequestOutputKind, **params) -> list[RequestOutput]:
    sampling = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1,
                              prompt_logprobs=1, output_kind=kind, **params)
    request_id = f"r{engine.num_steps}-{kind.value}"
    engine.add_request(request_id, engine.processor.process(PROMPT), sampling)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def joined(outputs: list[RequestOutput]) -> tuple[str, list[int], list[dict[int, float]]]:
    text, ids, logprobs = "", [], []
    for out in outputs:
        completion = out.outputs[0]
        text += completion.text
        ids += completion.token_ids
        logprobs += completion.logprobs or []
    return text, ids, logprobs


@pytest.mark.parametrize("extra", [{}, {"allowed_token_ids": LETTERS}])
def test_deltas_add_up_to_the_cumulative_output(engine, extra) -> None:
    cumulative = run(engine, RequestOutputKind.CUMULATIVE, **extra)
    final = cumulative[-1].outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == 40
    deltas = run(engine, RequestOutputKind.DELTA, **extra)
    assert joined(deltas) == (final.text, final.token_ids, final.logprobs)
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)  # one token each, no history
    assert deltas[0].prompt_logprobs == cumulative[-1].prompt_logprobs is not None
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert [d.finished for d in deltas] == [False] * 39 + [True]
    (only,) = run(engine, RequestOutputKind.FINAL_ONLY, **extra)
    assert only.finished and only.outputs[0] == final


@pytest.mark.parametrize("include", [False, True])
def test_a_stream_never_sends_text_a_stop_string_cuts(engine, include) -> None:
    letters = {"allowed_token_ids": LETTERS}
    free = run(engine, RequestOutputKind.FINAL_ONLY, **letters)[0].outputs[0].text
    stop = free[17:21]  # four letters from the middle: held back up to three at a time
    first = free.find(stop)
    params = dict(letters, stop=[stop], include_stop_str_in_output=include)
    (final,) = run(engine, RequestOutputKind.FINAL_ONLY, **params)
    want = free[: first + (len(stop) if include else 0)]
    assert final.outputs[0].text == want and final.outputs[0].stop_reason == stop
    deltas = run(engine, RequestOutputKind.DELTA, **params)
    sent = ""
    for delta in deltas:
        sent += delta.outputs[0].text
        assert want.startswith(sent)  # never a character the final reply lacks
    assert sent == want


def test_an_unknown_output_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="output_kind must be one of"):
        SamplingParams(output_kind="stream")
