"""Reuse never changes an answer, in the default mode: on both bundled models (native weights,
fp32, batch-invariant attention), each request's tokens and logprobs are the same bits alone, in
a batch of mixed-length requests with mixed sampling settings, with its prefix cached or not,
under chunked-prefill budgets of 64, 512 and 2,048 tokens, loaded from the disk store by a
second process, and from Redis. A test of the opt-out (batch_invariant=False) shows the checks
can fail: cascade attention over the shared system text moves last bits there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmemo import LLM
from tests.engine.invariance_requests import answers

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[2]
COUNT = {"smollm2": 32, "gemma3": 8}  # Gemma's 262k-row head makes each step dearer


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request) -> str:
    if request.param == "smollm2":
        from kvmemo.model.loading.loader import bundled_model_path

        return bundled_model_path()
    return str(request.getfixturevalue("gemma3_gguf"))


@pytest.fixture(scope="module")
def batched(model, default_env):
    """Every request in one batch, on a cold engine: what the other cases must equal."""
    llm = LLM(model, kv_cache_memory="256MiB")
    assert llm.engine.config.batch_invariant
    reference = answers(llm, COUNT[_name(model)])
    cached = answers(llm, COUNT[_name(model)])  # the same batch again: every prefix cached
    assert llm.get_metrics().prefix_cache_hits_tokens > 0
    return llm, reference, cached


def _name(model: str) -> str:
    return "gemma3" if "gemma" in model.lower() else "smollm2"


def test_cached_prefixes_give_the_same_bits(batched) -> None:
    _, reference, cached = batched
    assert cached == reference


def test_each_request_alone_gives_the_same_bits(batched) -> None:
    llm, reference, _ = batched
    count = len(reference)
    for i in range(0, count, 4):  # a quarter of them, each alone on a cold cache
        llm.reset_prefix_cache()
        assert answers(llm, count, only=[i]) == [reference[i]], f"request {i}"


@pytest.mark.parametrize("budget", [64, 512, 2048])
def test_chunked_prefill_budgets_give_the_same_bits(model, batched, budget: int) -> None:
    _, reference, _ = batched
    llm = LLM(model, kv_cache_memory="256MiB", max_num_batched_tokens=budget,
              enable_prefix_caching=False)
    assert answers(llm, len(reference)) == reference


def test_blocks_from_the_disk_store_in_a_second_process_and_from_redis(model, batched,
                                                                       tmp_path) -> None:
    """One engine here writes both stores (tiered); a second process reads the disk store, a
    fresh engine here reads Redis: the same bits as computing everything."""
    pytest.importorskip("redis")
    from tests.redis_server import RedisServer

    _, reference, _ = batched
    disk = f"disk:{tmp_path / 'store'}"
    with RedisServer() as server:
        writer = LLM(model, kv_cache_memory="256MiB", kv_store=(disk, server.url))
        assert answers(writer, len(reference)) == reference
        assert writer.get_metrics().store_hit_tokens == 0
        writer.engine.flush_kv_store()
        del writer
        second = _worker(model, disk, len(reference))
        assert second["store_hit_tokens"] > 0 and second["answers"] == _as_json(reference)
        reader = LLM(model, kv_cache_memory="256MiB", kv_store=server.url)
        assert answers(reader, len(reference)) == reference
        assert reader.get_metrics().store_hit_tokens > 0


def test_the_opt_out_is_not_invariant(model, batched) -> None:
    """Without batch invariance, the cached run of the same batch moves last bits (cascade
    attention and flash prefill): what the checks above would catch."""
    if _name(model) != "smollm2":
        pytest.skip("one model shows it")
    _, reference, _ = batched
    llm = LLM(model, kv_cache_memory="256MiB", batch_invariant=False)
    first = answers(llm, len(reference))
    assert answers(llm, len(reference)) != first


def _worker(model: str, store: str, count: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.invariance_requests", model, store,
         "--requests", str(count)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
        env={key: value for key, value in os.environ.items()
             if key not in ("KVMEMO_WEIGHTS", "KVMEMO_DTYPE")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _as_json(reference) -> list:
    return json.loads(json.dumps(reference))
