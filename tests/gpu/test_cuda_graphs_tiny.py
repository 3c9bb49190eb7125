"""CUDA graphs on a tiny random Llama (three layers, GQA 3): replayed decode steps give the eager
steps' tokens and logprobs bit for bit, and greedy tokens equal transformers on the same GPU. Needs no real weights,
so it runs on a GPU machine before the bundled model is there."""

from __future__ import annotations

import pytest
import torch

from kvmemo import LLM, SamplingParams
from tests.gpu.hf_reference import hf_greedy
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
    # Triton GEMMs and attention are batch-invariant: a bucket's padded rows change no bit.
    assert run(eager, prompts) == replayed
    assert run(eager, prompts[3:4]) == alone
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).cuda().eval()
    for ids, want in zip(prompts, replayed[0]):
        assert hf_greedy(hf, ids, 24) == want
