"""A CPU decode step's layers in one C call (engine/decode_chain.py) give the same bits as the
step layer by layer from Python (enforce_eager), on both bundled models in the default mode: the
tokens and logprobs of mixed-length requests with mixed sampling settings, Gemma 3's past its
512-token sliding window (each layer group's own tables and first keys). The chain is checked to
serve the decode steps, and not to be built where it does not apply.
"""

from __future__ import annotations

import pytest

from kvmemo import LLM, SamplingParams
from tests.engine.invariance_requests import Answer, answers

pytestmark = pytest.mark.model

COUNT = 8
LONG = "The archive lists every ship that entered the harbour, its cargo and its crew. " * 45


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request, default_env) -> str:
    if request.param == "smollm2":
        from kvmemo.model.loading.loader import bundled_model_path

        return bundled_model_path()
    return str(request.getfixturevalue("gemma3_gguf"))


def _answers(llm: LLM) -> tuple[list[Answer], Answer]:
    """The invariance requests, then one prompt of ~700 tokens (past Gemma's window)."""
    mixed = answers(llm, COUNT)
    long = llm.generate([LONG + "Which ship came first?"],
                        SamplingParams(max_tokens=8, temperature=0.0, logprobs=2,
                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
    return mixed, (list(long.token_ids),
                   [{int(t): float(v) for t, v in step.items()} for step in long.logprobs])


def test_chain_gives_the_eager_steps_bits(model: str) -> None:
    chained = LLM(model, kv_cache_memory="256MiB")
    chain = chained.engine.runner.decode_chain
    assert chain is not None, "the default mode on the CPU builds the chain"
    served: list[int] = []
    run = chain.run

    def counted(ids, positions, layer_metadata):
        hidden = run(ids, positions, layer_metadata)
        served.append(hidden is not None)
        return hidden

    chain.run = counted  # type: ignore[method-assign]
    with_chain = _answers(chained)
    assert sum(served) >= 7 and all(served), "every decode step went through the chain"
    del chained
    eager = LLM(model, kv_cache_memory="256MiB", enforce_eager=True)
    assert eager.engine.runner.decode_chain is None
    assert _answers(eager) == with_chain


@pytest.mark.parametrize("options", [
    {"batch_invariant": False},  # the decode kernel may split keys: another call
    {"kv_cache_dtype": "fp8_e4m3"},  # pages the chain's fp32 write does not take
])
def test_chain_not_built_where_it_does_not_apply(default_env, options: dict) -> None:
    llm = LLM(kv_cache_memory="64MiB", **options)
    assert llm.engine.runner.decode_chain is None


def test_dense_weights_take_their_own_forward() -> None:
    llm = LLM(kv_cache_memory="64MiB", weights="dense")
    assert llm.engine.runner.decode_chain is None
