"""Every linear kernel the probe can choose equals F.linear (row and K tails, fp32 and bf16), and
the probe's per-machine cache is keyed, survives corruption and is only a cache."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kvmemo.model.layers import linear as linear_kernels
from kvmemo.model.layers import linear_probe
from kvmemo.model.layers.linear import CPU_KERNELS, KernelChoice, Linear, kernel_usable
from kvmemo.model.models.llama_fast import prepare

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


def usable_or_skip(name: str, dtype: torch.dtype) -> None:
    if not kernel_usable(name, dtype, CPU):
        pytest.skip(f"kernel {name} does not serve {dtype} here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", CPU_KERNELS)  # triton: test_triton_linear.py
@pytest.mark.parametrize("rows", [1, 7, 32, 128, 129, 300])  # both classes, and tails of each
@pytest.mark.parametrize("out_features,in_features", [(96, 576), (130, 70), (5, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_f_linear(dtype, kernel, rows, out_features, in_features, with_bias):
    usable_or_skip(kernel, dtype)
    torch.manual_seed(rows + out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype) if with_bias else None
    x = torch.randn(rows, in_features).to(dtype)
    prefill = kernel  # the skinny kernel too: the model's head uses it for both classes
    lin = Linear(weight, bias, KernelChoice(decode=kernel, prefill=prefill))
    assert lin.choice == KernelChoice(decode=kernel, prefill=prefill)  # nothing fell back
    got = lin(x)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == dtype and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])


def test_the_chosen_kernel_is_the_one_that_runs(monkeypatch):
    usable_or_skip("onednn", torch.float32)
    calls = []
    real = linear_kernels.onednn_matmul

    def spy(x, packed, bias):
        calls.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(linear_kernels, "onednn_matmul", spy)
    lin = Linear(torch.randn(64, 32), None, KernelChoice(decode="torch", prefill="onednn"))
    lin(torch.randn(4, 32))  # decode class: torch
    lin(torch.randn(linear_kernels.DECODE_ROWS + 1, 32))  # prefill class: oneDNN
    assert calls == [linear_kernels.DECODE_ROWS + 1]


def test_unusable_kernels_fall_back_to_torch():
    lin = Linear(torch.randn(8, 4).half(), None, KernelChoice(decode="skinny", prefill="onednn"))
    assert lin.choice == KernelChoice()  # fp16: neither the C kernel nor oneDNN here
    x = torch.randn(3, 4).half()
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))
    with pytest.raises(ValueError, match="linear kernel must be one of"):
        KernelChoice(decode="fast")


@pytest.fixture
def probe_cache(tmp_path, monkeypatch):
    """An empty cache directory and a counter of real measurements."""
    monkeypatch.setenv("KVMEMO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVMEMO_LINEAR_KERNEL", raising=False)
    measured = []
    real = linear_probe._measure

    def counting(weights):
        measured.append(weights[0].dtype)
        return real(weights)

    monkeypatch.setattr(linear_probe, "_measure", counting)
    return tmp_path / "linear-kernels.json", measured


def small_weights(dtype=torch.float32):
    return [torch.randn(48, 32).to(dtype), torch.randn(32, 48).to(dtype)]


def test_probe_runs_once_per_key_and_caches(probe_cache):
    path, measured = probe_cache
    first = linear_probe.choose_kernels(small_weights(), CPU)
    assert measured == [torch.float32] and path.is_file()
    entry = next(iter(json.loads(path.read_text())["entries"].values()))
    assert (entry["decode"], entry["prefill"]) == (first.decode, first.prefill)
    assert linear_probe.choose_kernels(small_weights(), CPU) == first
    assert measured == [torch.float32]  # served from the cache
    linear_probe.choose_kernels(small_weights(torch.bfloat16), CPU)  # another dtype: a new key
    linear_probe.choose_kernels([torch.randn(16, 8)], CPU)  # other shapes: a new key
    assert measured == [torch.float32, torch.bfloat16, torch.float32]
    assert len(json.loads(path.read_text())["entries"]) == 3


def test_key_covers_cpu_torch_threads_and_shapes(monkeypatch):
    base = linear_probe._key([(4, 4)], torch.float32)
    assert base != linear_probe._key([(4, 4)], torch.bfloat16)
    assert base != linear_probe._key([(4, 8)], torch.float32)
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert base != linear_probe._key([(4, 4)], torch.float32)
    monkeypatch.undo()
    monkeypatch.setattr(linear_probe, "_cpu_identity", lambda: "another CPU")
    assert base != linear_probe._key([(4, 4)], torch.float32)


@pytest.mark.parametrize(
    "garbage",
    [b"\x00\xff not json", b'{"version": 1, "entries": []}', b'{"version": 99, "entries": {}}',
     b"[1, 2]", b""],
)
def test_a_corrupt_cache_means_probing_again(probe_cache, garbage):
    path, measured = probe_cache
    path.write_bytes(garbage)
    choice = linear_probe.choose_kernels(small_weights(), CPU)
    assert measured == [torch.float32] and isinstance(choice, KernelChoice)
    data = json.loads(path.read_text())  # rewritten whole and valid
    assert data["version"] == linear_probe.CACHE_VERSION and len(data["entries"]) == 1


def test_a_malformed_entry_means_probing_again(probe_cache):
    path, measured = probe_cache
    key = linear_probe._key([(48, 32), (32, 48)], torch.float32)
    path.write_text(json.dumps({"version": 1, "entries": {key: {"decode": "warp-drive"}}}))
    linear_probe.choose_kernels(small_weights(), CPU)
    assert measured == [torch.float32]


def test_environment_forces_a_kernel(probe_cache, monkeypatch):
    _, measured = probe_cache
    monkeypatch.setenv("KVMEMO_LINEAR_KERNEL", "skinny")
    assert linear_probe.choose_kernels(small_weights(), CPU) == KernelChoice("skinny", "torch")
    monkeypatch.setenv("KVMEMO_LINEAR_KERNEL", "nope")
    with pytest.raises(ValueError, match="KVMEMO_LINEAR_KERNEL"):
        linear_probe.choose_kernels(small_weights(), CPU)
    assert measured == []


def tiny_model(tie: bool):
    from kvmemo.model.config import ModelArchConfig
    from kvmemo.model.models.llama import LlamaForCausalLM
    from tests.model.tiny import tiny_hf_model

    hf = tiny_hf_model("llama")
    config = ModelArchConfig.from_hf_config({**hf.config.to_dict(), "tie_word_embeddings": tie})
    state = hf.state_dict()
    if not tie:
        state["lm_head.weight"] = state["lm_head.weight"] + 0.01  # a head of its own
    return LlamaForCausalLM.from_state_dict(config, state)


@pytest.mark.parametrize("packed", [KernelChoice("onednn", "onednn"), KernelChoice("skinny", "onednn")])
@pytest.mark.parametrize("tie", [True, False])
def test_packed_kernels_release_the_plain_weights_and_rebinding_restores_them(tie, packed):
    for name in (packed.decode, packed.prefill):
        usable_or_skip(name, torch.float32)
    from tests.model.tiny import caching_attention

    model = tiny_model(tie)
    plain = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.arange(3, 40)
    prepare(model, KernelChoice("torch", "torch"))
    expected = model.compute_logits(model(ids, torch.arange(len(ids)), caching_attention()[0]))

    prepare(model, packed)
    projections = [n for n in plain if n.endswith("proj.weight") or (n == "lm_head.weight" and not tie)]
    assert projections and all(model.get_parameter(n).numel() == 0 for n in projections)
    assert model.embed_tokens.weight.numel() > 0  # read by lookups (and by a tied head)
    got = model.compute_logits(model(ids, torch.arange(len(ids)), caching_attention()[0]))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    prepare(model, KernelChoice("torch", "onednn"))  # reads plain weights again
    for name, value in plain.items():
        assert torch.equal(model.get_parameter(name), value), name  # rebuilt exactly
    again = model.compute_logits(model(ids, torch.arange(len(ids)), caching_attention()[0]))
    torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-5)


def test_a_kernel_that_reads_the_plain_weight_keeps_it():
    lin = Linear(torch.randn(8, 4), None, KernelChoice("torch", "onednn"))
    with pytest.raises(ValueError, match="cannot be released"):
        lin.release_plain()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_released_skinny_weights_rebuild_exactly_from_panels(dtype):
    usable_or_skip("skinny", dtype)
    weight = torch.randn(70, 33).to(dtype)
    lin = Linear(weight.clone(), None, KernelChoice("skinny", "torch"))
    assert not lin.packed_only  # prefill on torch reads the plain weight
    lin = Linear(weight.clone(), None, KernelChoice("skinny", "onednn"))
    if lin.choice.prefill != "onednn":
        pytest.skip("oneDNN does not serve this dtype here")
    lin.release_plain()
    assert lin.weight is None and torch.equal(lin.dense(), weight)
    x = torch.randn(3, 33).to(dtype)
    torch.testing.assert_close(lin(x).float(), F.linear(x.float(), weight.float()),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("tie", [True, False])
def test_the_head_is_packed_once_where_the_few_row_gemm_serves_decode(tie):
    """The layers hold panels and oneDNN's copy; the head (113 MB in SmolLM2's fp32) only
    panels, which serve its rare products past the decode class too."""
    for name in ("skinny", "onednn"):
        usable_or_skip(name, torch.float32)
    from tests.model.tiny import caching_attention

    model = tiny_model(tie)
    ids = torch.arange(3, 40)
    prepare(model, KernelChoice("torch", "torch"))
    hidden = model(ids, torch.arange(len(ids)), caching_attention()[0])
    expected = model.compute_logits(hidden)
    prepare(model, KernelChoice("skinny", "onednn"))
    assert model.head.choice == KernelChoice("skinny", "skinny")
    weight = model.head.dense()
    assert model.head.packed_bytes < 2 * weight.numel() * weight.element_size()  # one copy
    rows = linear_kernels.DECODE_ROWS + 3  # past the decode class: the panels still serve
    many = hidden[:1].expand(rows, -1).contiguous()
    torch.testing.assert_close(model.compute_logits(many), expected[:1].expand(rows, -1),
                               rtol=1e-4, atol=1e-4)
