"""A dropped engine gives its weights back at once: nothing in it refers back to its model, so
reference counting frees it without waiting for the cyclic collector (which runs on object
counts, not bytes: a notebook that makes a second `LLM` held two sets of weights)."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvmemo import LLM


@pytest.mark.parametrize("weights", ["dense", "native"])
def test_a_dropped_llm_frees_its_model_without_the_cyclic_collector(weights, monkeypatch) -> None:
    monkeypatch.setenv("KVMEMO_WEIGHTS", weights)
    llm = LLM(num_blocks=64)
    model = weakref.ref(llm.engine.runner.model)
    largest = weakref.ref(max(llm.engine.runner.model.parameters(), key=lambda p: p.numel()))
    gc.collect()
    gc.disable()
    try:
        del llm
        assert model() is None and largest() is None
    finally:
        gc.enable()
