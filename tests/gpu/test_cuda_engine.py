"""The engine on a GPU: greedy tokens equal HF transformers (fp32, both on the GPU), bf16 agrees
teacher-forced, caching on = off, the disk store = recompute, beam search = HF.

Skipped without CUDA; `scripts/gpu_check.sh` runs them on a lent GPU (the Triton kernels' own
tests, tests/attention/test_triton_kernels.py, run there on the device too)."""

from __future__ import annotations

import copy

import pytest
import torch

from kvmemo import LLM, SamplingParams
from tests.engine.prompts import CHAT_PROMPTS, RAW_PROMPTS
from tests.engine.test_beam_search import assert_same_beams, hf_beam_search
from tests.gpu.hf_reference import hf_greedy, hf_teacher_forced
from tests.model.test_native_weights import _teacher_forced

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.model,
]

NUM_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def gpu_llm():
    llm = LLM(device="cuda", dtype="float32", weights="dense", num_blocks=1024)
    assert llm.engine.runner.attention_backend.name == "triton"
    return llm


@pytest.fixture(scope="module")
def hf_gpu(hf_model):
    return copy.deepcopy(hf_model).to("cuda")  # the session's CPU reference stays on the CPU


@pytest.fixture(scope="module")
def prompt_ids(gpu_llm) -> list[list[int]]:
    processor = gpu_llm.engine.processor
    return ([processor.encode_prompt(p) for p in RAW_PROMPTS]
            + [processor.encode_chat(c)[1] for c in CHAT_PROMPTS])


@pytest.fixture(scope="module")
def hf_tokens(hf_gpu, prompt_ids) -> list[list[int]]:
    return [hf_greedy(hf_gpu, ids, NUM_NEW) for ids in prompt_ids]


def tokens_and_logprobs(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t] for t, step in zip(ids, o.outputs[0].logprobs)]
                for ids, o in zip(tokens, outs)]
    return tokens, logprobs


def test_greedy_fp32_equals_transformers_on_the_gpu(gpu_llm, prompt_ids, hf_tokens) -> None:
    gpu_llm.reset_prefix_cache()
    batched, _ = tokens_and_logprobs(gpu_llm, prompt_ids)
    assert batched == hf_tokens
    for ids, want in zip(prompt_ids[:3], hf_tokens[:3]):  # and one at a time
        assert tokens_and_logprobs(gpu_llm, [ids])[0] == [want]


def test_graph_replays_equal_eager_steps(gpu_llm, prompt_ids) -> None:
    """Decode steps replayed from CUDA graphs (the default) and run eagerly: the same tokens and
    logprobs, bit for bit, batched and alone (a bucket's padding rows change nothing: the Triton
    GEMMs and attention are batch-invariant)."""
    gpu_llm.reset_prefix_cache()
    replayed = tokens_and_logprobs(gpu_llm, prompt_ids)
    alone = tokens_and_logprobs(gpu_llm, prompt_ids[:1])
    graphs = gpu_llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.enabled and graphs.graphs, "no graph was captured"
    assert gpu_llm.engine.runner.model.linear_choice.decode == "triton"
    eager = LLM(device="cuda", dtype="float32", weights="dense", num_blocks=1024,
                enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None
    assert tokens_and_logprobs(eager, prompt_ids) == replayed
    assert tokens_and_logprobs(eager, prompt_ids[:1]) == alone
    assert alone[0][0] == replayed[0][0] and alone[1][0] == replayed[1][0]


def test_caching_on_equals_off(gpu_llm, prompt_ids) -> None:
    """Cached (second run: prefixes hit) and uncached runs: the same tokens and logprobs."""
    gpu_llm.reset_prefix_cache()
    cold = tokens_and_logprobs(gpu_llm, prompt_ids)
    warm = tokens_and_logprobs(gpu_llm, prompt_ids)
    assert gpu_llm.engine.kv_manager.stats.num_hit_tokens > 0
    off = LLM(device="cuda", dtype="float32", weights="dense", num_blocks=1024,
              enable_prefix_caching=False)
    assert cold == warm == tokens_and_logprobs(off, prompt_ids)


def test_disk_store_equals_recompute(tmp_path, prompt_ids) -> None:
    """Blocks saved by one engine and loaded into a fresh one's GPU pages: the same answers as
    computing them."""
    store = f"disk:{tmp_path / 'kv'}"
    first = LLM(device="cuda", dtype="float32", weights="dense", num_blocks=1024, kv_store=store)
    computed = tokens_and_logprobs(first, prompt_ids)
    del first
    second = LLM(device="cuda", dtype="float32", weights="dense", num_blocks=1024, kv_store=store)
    loaded = tokens_and_logprobs(second, prompt_ids)
    assert loaded == computed


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beam_search_equals_transformers(gpu_llm, hf_gpu, prompt_ids, beam_width) -> None:
    gpu_llm.reset_prefix_cache()
    prompts = prompt_ids[:4]
    outs = gpu_llm.beam_search(prompts, beam_width=beam_width, max_tokens=5, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert_same_beams(out, hf_beam_search(hf_gpu, ids, beam_width, 5))


def test_bf16_agrees_teacher_forced(hf_gpu, prompt_ids, hf_tokens) -> None:
    """bf16 on the GPU: next tokens after the fp32 continuation agree at >= 99% of positions.
    HF's own bf16 model is measured beside it (printed): how often bf16 itself flips this
    model's near-ties."""
    llm = LLM(device="cuda", dtype="bfloat16", weights="dense", num_blocks=1024,
              enable_prefix_caching=False)
    assert llm.engine.runner.model.compute_dtype == torch.bfloat16
    hf_bf16 = copy.deepcopy(hf_gpu).to(torch.bfloat16)
    same = hf_same = total = 0
    for ids, ref in zip(prompt_ids, hf_tokens):
        got = _teacher_forced(llm, ids, ref)
        same += sum(a == b for a, b in zip(got, ref))
        hf_same += sum(a == b for a, b in zip(hf_teacher_forced(hf_bf16, ids, ref), ref))
        total += len(ref)
    print(f"bf16 teacher-forced agreement with fp32 HF: kvmemo {same}/{total}, "
          f"HF bf16 {hf_same}/{total}")
    assert same >= 0.99 * total, (f"bf16 agrees with fp32 at {same} of {total} positions "
                                  f"(HF's bf16: {hf_same})")
