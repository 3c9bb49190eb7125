"""Multimodal fixtures: engines over the session's tiny LLaVA (`llava`, tests/conftest.py) with
prefix caching on (small step budget, so chunked prefill splits images) and off."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")


@pytest.fixture(scope="session")
def llm_on(llava):
    from kvmemo import LLM

    # No partial-block reuse: the tests then state exactly which full blocks may be hits.
    return LLM(
        model=str(llava[0]),
        device="cpu",
        block_size=8,
        num_blocks=512,
        max_num_batched_tokens=24,
        enable_partial_reuse=False,
    )


@pytest.fixture(scope="session")
def llm_off(llava):
    from kvmemo import LLM

    return LLM(
        model=str(llava[0]), device="cpu", block_size=8, num_blocks=512, enable_prefix_caching=False
    )


@pytest.fixture(autouse=True)
def _all_blocks_free_after_test(request):
    yield
    from tests.helpers import assert_all_blocks_free

    for name in ("llm_on", "llm_off"):
        if name in request.fixturenames:
            assert_all_blocks_free(request.getfixturevalue(name))
