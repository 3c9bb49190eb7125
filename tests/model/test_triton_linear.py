"""The GPU's linear layers, the Triton GEMM (model/kernels/triton_linear.py), under Triton's
interpreter: it equals F.linear, a row's bits do not depend on the rows around it, a GPU chooses
it, and an engine on it (with the Triton attention) answers alike batched, alone and cached."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvmemo.model.layers import linear_probe
from kvmemo.model.layers.linear import KernelChoice, Linear, kernel_usable
from kvmemo.triton_support import triton_unavailable_reason

CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a GPU: the real kernel
pytestmark = [
    pytest.mark.native_isa_only,  # Triton's interpreter runs NumPy whatever the ISA level
    pytest.mark.skipif(triton_unavailable_reason(DEVICE) is not None,
                       reason=f"Triton cannot run here: {triton_unavailable_reason(DEVICE)}"),
]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=1e-1),
             torch.float16: dict(rtol=2e-3, atol=2e-2)}


def triton_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    lin = Linear(weight, bias, KernelChoice("triton", "triton"))
    assert lin.choice == KernelChoice("triton", "triton")  # nothing fell back to torch
    return lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 17, 40])  # one tile, a tail, several tiles
@pytest.mark.parametrize("out_features,in_features", [(96, 70), (130, 64), (5, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear(dtype, rows, out_features, in_features, with_bias) -> None:
    torch.manual_seed(rows + out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features).to(DEVICE, dtype)
    bias = torch.randn(out_features).to(DEVICE, dtype) if with_bias else None
    x = torch.randn(rows, in_features).to(DEVICE, dtype)
    got = triton_linear(weight, bias)(x)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == dtype and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_in_any_batch(dtype) -> None:
    """Rows alone, in batches of every tile remainder and at other offsets: identical bits (the
    property cuBLAS lacks: it picks kernels by row count)."""
    torch.manual_seed(1)
    weight = torch.randn(100, 200).to(DEVICE, dtype)
    x = torch.randn(40, 200).to(DEVICE, dtype)
    lin = triton_linear(weight, torch.randn(100).to(DEVICE, dtype))
    full = lin(x)
    for lo, hi in ((0, 1), (3, 4), (39, 40), (5, 22), (17, 40), (0, 33)):
        assert torch.equal(lin(x[lo:hi]), full[lo:hi]), (lo, hi)
    # A row inside a 3-d batch [B, T, K] as the model passes them.
    assert torch.equal(lin(x.view(4, 10, 200))[2, 3], full[23])


def test_bad_input_names_what_is_allowed() -> None:
    from kvmemo.model.kernels import triton_linear as kernel

    with pytest.raises(ValueError, match="one dtype among"):
        kernel.linear(torch.randn(2, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE).half(),
                      None)
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        kernel.linear(torch.randn(2, 8, device=DEVICE), torch.randn(4, 9, device=DEVICE), None)
    ints = dict(dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="one dtype among"):
        kernel.linear(torch.ones(2, 8, **ints), torch.ones(4, 8, **ints), None)


def test_a_gpu_chooses_the_triton_gemm_and_a_cpu_never_probes_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVMEMO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVMEMO_LINEAR_KERNEL", raising=False)
    weights = [torch.randn(48, 32), torch.randn(32, 48)]
    cuda = torch.device("cuda")
    if torch.cuda.is_available():
        assert linear_probe.choose_kernels(weights, cuda) == KernelChoice("triton", "triton")
    monkeypatch.setattr("kvmemo.model.layers.linear.triton_unavailable_reason", lambda d: None)
    assert kernel_usable("triton", torch.float32, cuda)
    assert linear_probe.choose_kernels(weights, cuda) == KernelChoice("triton", "triton")
    choice = linear_probe.choose_kernels(weights, CPU)  # the CPU probe: its own kernels only
    assert "triton" not in (choice.decode, choice.prefill)
    monkeypatch.setattr("kvmemo.model.layers.linear.triton_unavailable_reason",
                        lambda d: "no triton")
    assert linear_probe.choose_kernels(weights, cuda) == KernelChoice()  # torch's


def test_the_plain_weight_stays_for_the_triton_gemm() -> None:
    lin = triton_linear(torch.randn(8, 16, device=DEVICE))
    assert not lin.packed_only
    with pytest.raises(ValueError, match="read by a chosen kernel"):
        lin.release_plain()


@pytest.fixture(scope="module")
def tiny_llama_512(tmp_path_factory) -> Path:
    """A random 2-layer Llama with 512 ids of the bundled tokenizer's vocabulary (the
    interpreter runs the head's GEMM in NumPy: a 49,152-row head would take minutes)."""
    from tests.gpu.tiny_llama import save_tiny_llama

    directory = tmp_path_factory.mktemp("tiny_llama_512")
    save_tiny_llama(directory, vocab_size=512, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=1024)
    return directory


def test_the_gpu_numeric_path_answers_alike_batched_alone_and_cached(
        tiny_llama_512, monkeypatch) -> None:
    """The engine on the GPU's kernels (Triton GEMMs and attention; here the interpreter): a
    prompt's tokens and logprobs are the same bits batched, alone, and from the prefix cache."""
    from kvmemo import LLM, SamplingParams

    monkeypatch.setenv("KVMEMO_LINEAR_KERNEL", "triton")
    llm = LLM(str(tiny_llama_512), device=str(DEVICE), dtype="float32", num_blocks=128,
              block_size=16, attention_backend="triton")
    assert llm.engine.runner.model.linear_choice == KernelChoice("triton", "triton")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (40, 9, 23)]
    prompts[2][:16] = prompts[0][:16]  # a shared first block: a hit in the batched run

    def run(batch: list[list[int]]):
        outs = llm.generate(batch, params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]

    batched = run(prompts)
    hits = llm.engine.kv_manager.stats.num_hit_tokens
    cached = run(prompts)  # every full prompt block from the cache
    assert llm.engine.kv_manager.stats.num_hit_tokens > hits
    alone = run(prompts[2:3])
    assert cached == batched
    assert alone == batched[2:3]
