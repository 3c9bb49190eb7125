"""CUDA graphs on a tiny random Llama (three layers, GQA 3): replayed decode steps give the eager
steps' tokens (logprobs within 1e-4), and greedy tokens equal transformers on the same GPU. Needs no real weights,
so it runs on a GPU machine before the bundled model is there."""

from __future__ import annotations

import pytest
import torch

from kvmemo import LLM, SamplingParams
from tests.gpu.tiny_llama import tiny_llama_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)


def run(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, [[s[t] for t, s in zip(ids, o.outputs[0].logprobs)]
                    for ids, o in zip(tokens, outs)]


def test_tiny_llama_graphs_equal_eager_and_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    directory = tiny_llama_dir(tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40000, (n,), generator=g).tolist() for n in (3, 17, 40, 300, 9)]
    graphs = LLM(str(directory), device="cuda", dtype="float32", num_blocks=512)
    replayed = run(graphs, prompts)
    captured = graphs.engine.runner.decode_graphs
    assert captured is not None and captured.enabled and captured.graphs
    alone = run(graphs, prompts[3:4])  # another bucket
    eager = LLM(str(directory), device="cuda", dtype="float32", num_blocks=512,
                enforce_eager=True)
    # Attention is batch-invariant; cuBLAS picks its GEMM kernels by row count, so a bucket's
    # padded rows can move the last bits of the linear layers: tokens equal, logprobs close.
    for (tokens, logprobs), (want_tokens, want_logprobs) in (
            (run(eager, prompts), replayed), (run(eager, prompts[3:4]), alone)):
        assert tokens == want_tokens
        torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-4)
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).cuda().eval()
    for ids, want in zip(prompts, replayed[0]):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=24,
                              min_new_tokens=24, do_sample=False)
        assert out[0, len(ids):].tolist() == want
