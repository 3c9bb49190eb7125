"""dtype="bfloat16": the products and attention compute in bf16, the residual stream, norms, the
MLP's activation and the lm_head in fp32 (LlamaForCausalLM.forward), so the bundled model's
teacher-forced next tokens agree with the exact fp32 mode almost everywhere. The benchmark's
figure over 1,024 positions is in docs/benchmarks.md (bench_fp8, "bf16 compute")."""

from __future__ import annotations

import pytest
import torch

from kvmemo import LLM, SamplingParams
from tests.model.test_native_weights import _teacher_forced

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "The three primary colors are", "import numpy as np\n\ndef normalize(x):\n",
           "Photosynthesis is the process by which"]


@pytest.mark.model
def test_bundled_model_bf16_agrees_with_fp32() -> None:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    exact = LLM(dtype="float32", num_blocks=256, enable_prefix_caching=False)
    reference = [list(o.outputs[0].token_ids) for o in exact.generate(PROMPTS, params, use_tqdm=False)]
    del exact
    llm = LLM(dtype="bfloat16", num_blocks=256, enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.compute_dtype == torch.bfloat16
    assert model.layers[0].qkv.dense().dtype == torch.bfloat16
    assert model.head.dense().dtype == torch.float32
    encoded = [llm.engine.processor.encode_prompt(p) for p in PROMPTS]
    same = sum(a == b for ids, ref in zip(encoded, reference)
               for a, b in zip(_teacher_forced(llm, ids, ref), ref))
    # Of 192 positions, measured on Zen 5: 191 agree; 188 with the stream, norms, activation
    # and head in bf16 as well (the mode before), which this bound rejects.
    assert same >= 189, f"bf16 agrees with fp32 at {same} of {sum(map(len, reference))} positions"
