"""A tiny random Gemma 3 (HF safetensors): greedy tokens equal transformers' across the sliding
window, batched, in prefill chunks, with caching on and off; sliding groups hold only the window.
Runs everywhere (the real Gemma 3 GGUF tests are in test_gemma3_vs_hf.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvmemo import LLM, SamplingParams
from kvmemo.kv.layout import attention_type_groups
from kvmemo.model.config import ModelArchConfig
from kvmemo.model.loading.safetensors import read_raw_config
from tests.model.tiny_gemma3 import LAYER_TYPES, WINDOW, save_tiny_gemma3

NUM_NEW = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_gemma3")
    return directory, save_tiny_gemma3(directory)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (9, 23, 41, 70)]


@pytest.fixture(scope="module")
def expected(tiny, prompts):
    """transformers' greedy continuation of each prompt (its own sliding-window cache)."""
    _, hf = tiny
    out = []
    for ids in prompts:
        with torch.no_grad():
            seq = hf.generate(
                torch.tensor([ids]), max_new_tokens=NUM_NEW, do_sample=False, min_new_tokens=NUM_NEW
            )
        out.append(seq[0, len(ids) :].tolist())
    return out


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_config_reads_layer_types_rope_and_scale(tiny) -> None:
    directory, _ = tiny
    config = ModelArchConfig.from_hf_config(read_raw_config(directory))
    assert config.architecture == "gemma3"
    assert list(config.layer_types or ()) == LAYER_TYPES
    assert config.sliding_window == WINDOW
    assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert config.attention_scale == 24**-0.5
    assert config.sliding_layers() == (0, 1, 2, 4, 5, 6)


def test_layers_grouped_by_attention_type() -> None:
    windows = [WINDOW if t == "sliding_attention" else None for t in LAYER_TYPES]
    groups = attention_type_groups(windows)
    assert [g.layer_indices for g in groups] == [(3,), (0,), (1,), (2,), (4,), (5,), (6,)]
    assert [g.sliding_window for g in groups] == [None] + [WINDOW] * 6


@pytest.mark.parametrize(
    "settings",
    [
        {},  # one step per prompt, batched
        {"max_num_batched_tokens": 8},  # prefill in chunks that cross the window
        {"enable_prefix_caching": False},
    ],
    ids=["batched", "chunked", "no-cache"],
)
def test_greedy_equals_transformers(tiny, prompts, expected, settings) -> None:
    directory, _ = tiny
    llm = LLM(str(directory), block_size=8, num_blocks=256, **settings)
    assert llm.engine.layout.is_hybrid
    assert _greedy(llm, prompts) == expected
    for single, want in zip(prompts, expected):  # and one at a time
        assert _greedy(llm, [single]) == [want]
    llm.engine.kv_manager.check_invariants()


def test_cached_prefix_and_evictions_give_the_same_tokens(tiny, prompts, expected) -> None:
    """Requests sharing a long prefix hit the cache (window blocks included) and still equal
    transformers; a pool too small to keep them all evicts and stays exact."""
    directory, _ = tiny
    for num_blocks, chunk in ((256, 2048), (44, 16)):
        llm = LLM(
            str(directory), block_size=8, num_blocks=num_blocks, max_num_batched_tokens=chunk
        )
        base = prompts[3]
        shared = [base + [7, 8, 9], base + [10, 11], base]
        first = _greedy(llm, shared[:1])
        rest = _greedy(llm, shared[1:])
        cold = LLM(str(directory), block_size=8, num_blocks=256, enable_prefix_caching=False)
        assert first + rest == _greedy(cold, shared)
        assert rest[-1] == expected[3]
        stats = llm.engine.kv_manager.stats
        assert stats.num_hit_tokens > 0
        if num_blocks == 44:
            assert stats.num_evicted_blocks > 0
        llm.engine.kv_manager.check_invariants()


def test_sliding_groups_hold_only_the_window(tiny) -> None:
    """A 160-token sequence holds full_layers x 160 + sliding_layers x (window + one block)
    tokens' worth of KV at most, read from the pool's counters while it runs."""
    directory, _ = tiny
    llm = LLM(str(directory), block_size=8, num_blocks=512, max_num_batched_tokens=8)
    engine = llm.engine
    layout = engine.layout
    num_full = LAYER_TYPES.count("full_attention")
    num_sliding = LAYER_TYPES.count("sliding_attention")
    prompt = list(range(100, 248))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("long", engine.processor.process(prompt), params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        manager = engine.kv_manager
        held = manager.num_blocks - manager.num_free_blocks
        peak = max(peak, held)
        (request,) = engine.scheduler.running or [None]
        if request is None:
            continue
        num_tokens = -(-request.num_computed_tokens // 8) * 8 + 8  # the block being filled too
        # A prefill chunk of 8 may add one more block to each sliding group.
        bound = num_full * num_tokens + num_sliding * (WINDOW + 8 + 8)
        assert held * layout.layers_per_block * layout.block_size <= bound
    total = len(prompt) + 12
    full_only = len(LAYER_TYPES) * -(-total // 8)  # what a full-attention layout would hold
    assert peak < full_only / 3


def test_beam_search_equals_transformers_and_is_cache_independent(tiny, prompts) -> None:
    """Beams fork and release blocks in every group; the result equals HF's beam search and
    does not change when the prefix is already cached (the same prompt twice)."""
    directory, hf = tiny
    ids = prompts[2]  # 41 tokens: the window (16) slides during the search
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([ids]), num_beams=3, do_sample=False, max_new_tokens=10,
            min_new_tokens=10, early_stopping=False,
        )[0, len(ids) :].tolist()
    llm = LLM(str(directory), block_size=8, num_blocks=256)
    for _ in range(2):
        (out,) = llm.beam_search([ids], beam_width=3, max_tokens=10, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == want
    llm.engine.kv_manager.check_invariants()


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_store_serves_a_fresh_engine_every_layer_group(tiny, prompts, expected, tmp_path, tier):
    """One engine saves (every layer of a block, gathered from each group's page); a fresh one
    with an empty pool loads the prefix from the store and still equals transformers."""
    directory, _ = tiny
    with contextlib.ExitStack() as stack:
        if tier == "redis":
            from tests.redis_server import RedisServer

            store = stack.enter_context(RedisServer()).url
        else:
            store = f"disk:{tmp_path}"
        writer = LLM(str(directory), block_size=8, num_blocks=256, kv_store=store)
        assert _greedy(writer, prompts[3:]) == expected[3:]
        writer.engine.flush_kv_store()
        reader = LLM(str(directory), block_size=8, num_blocks=256, kv_store=store)
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        (out,) = reader.generate([prompts[3]], params, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == expected[3]
        assert out.metrics.num_cached_tokens >= 64  # 8 of its 70 prompt tokens' blocks loaded
        assert reader.engine.kv_connector is not None
        assert reader.engine.kv_connector.stats.hit_tokens >= 64
        reader.engine.kv_manager.check_invariants()


def test_kv_events_announce_the_full_attention_groups_blocks(tiny, prompts) -> None:
    """Events speak for group 0 only: one BlockStored per full block, as a plain model's."""
    directory, _ = tiny
    llm = LLM(str(directory), block_size=8, num_blocks=256, enable_kv_events=True)
    seen = []
    llm.engine.subscribe_kv_events(seen.extend)
    _greedy(llm, [prompts[3]])
    stored = [h for e in seen if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    assert len(stored) == (len(prompts[3]) + NUM_NEW - 1) // 8
    assert len(set(stored)) == len(stored)
    assert sorted(llm.engine.cached_block_hashes()) == sorted(stored)


def test_preemption_under_a_small_pool_stays_exact(tiny, prompts, expected) -> None:
    """Four requests that cannot all hold their blocks at once: the newest are preempted (every
    group's blocks freed) and recomputed or re-hit later, and all still equal transformers."""
    directory, _ = tiny
    llm = LLM(str(directory), block_size=8, num_blocks=48, max_num_batched_tokens=16)
    assert _greedy(llm, prompts) == expected
    assert llm.engine.stats().num_preemptions > 0
    llm.engine.kv_manager.check_invariants()


@pytest.mark.native_isa_only  # Triton's interpreter runs NumPy whatever the ISA level
def test_triton_backend_equals_transformers(tiny, prompts, expected) -> None:
    """The engine on the Triton kernels (the GPU's backend; here Triton's interpreter): the same
    greedy tokens, over sliding and full layers, in prefill chunks that cross the window."""
    from kvmemo.triton_support import triton_unavailable_reason

    device = "cuda" if torch.cuda.is_available() else "cpu"
    reason = triton_unavailable_reason(device)
    if reason is not None:
        pytest.skip(f"Triton kernels cannot run: {reason}")
    directory, _ = tiny
    llm = LLM(str(directory), block_size=8, num_blocks=256, max_num_batched_tokens=16,
              attention_backend="triton", device=device)
    assert llm.engine.runner.attention_backend.name == "triton"
    # Two prompts (23 and 70 tokens) keep the interpreter's run short; the longer crosses the
    # window several times.
    assert _greedy(llm, [prompts[1], prompts[3]]) == [expected[1], expected[3]]
    llm.engine.kv_manager.check_invariants()
