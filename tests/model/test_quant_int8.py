"""The int8-activation kernel (quant_int8.py) against gguf-py and torch.

Products equal F.linear of the int8-rounded activations and gguf.quants.dequantize's weights to
fp32 rounding, for every type it reads, over row tails (M up to 33, tiles of 4), output tails and
odd block counts (the 512-bit path takes blocks in pairs); and they stay within the stated bound
of F.linear on the exact activations. The same checks run through the kernel built for AVX2
(x86-64-v3) and plain C (x86-64) where this CPU can run them, so every path is tested on any
machine that has it. The fused options (norm, SiLU gating, residual, RoPE, the MLP block) are
checked against torch doing the same arithmetic.
"""

from __future__ import annotations

import mmap
import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvmemo.model.kernels import quant_int8
from kvmemo.model.kernels.quant_int8 import (
    INT8_TYPES,
    Fused,
    Int8Weights,
    activation_group,
    int8_kernel_available,
    mlp_block,
    quantize_activations,
)
from kvmemo.model.kernels.quant_linear import QuantizedWeight
from kvmemo.model.layers.basic import apply_rotary
from kvmemo.native import cpu_flags as native_cpu_flags
from tests.model.test_quant_linear import random_blocks

GROUP = 16  # activation values per int8 scale: the documented contract (kernels/quant_int8.c)

pytestmark = pytest.mark.skipif(not int8_kernel_available(), reason="no C compiler")
T = GGMLQuantizationType


def _cpu_flags() -> set[str]:
    line = native_cpu_flags()  # the flags line kvmemo.native keys its builds by
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def _builds() -> list[str]:
    """The kernel builds this machine runs: its own, then the AVX2 and plain-C paths."""
    builds = ["native"]
    if platform.machine() == "x86_64":
        if {"avx2", "fma", "f16c", "bmi2"} <= _cpu_flags():
            builds.append("x86-64-v3")
        builds.append("x86-64")
    return builds


@pytest.fixture(params=_builds())
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    library = quant_int8.kernel_library(request.param)
    if library is None:
        pytest.skip(f"the kernel does not build for {request.param}")
    monkeypatch.setattr(quant_int8, "_library", lambda: library)
    return request.param


def _weight(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int
            ) -> tuple[QuantizedWeight, torch.Tensor]:
    raw = random_blocks(qtype, rows, cols, seed)
    dense = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    return QuantizedWeight.from_numpy(f"w.{qtype.name}", qtype, raw), dense


def _rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x after the kernel's quantization (its codes times their scales) and the scales [M, K]."""
    codes, scales = quantize_activations(x)
    per_value = scales.repeat_interleave(GROUP, dim=1)
    return codes.float() * per_value, per_value


def test_activation_codes_are_round_to_nearest_with_scale_amax_over_127() -> None:
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * 3
    x[2, 32:48] = 0.0  # an all-zero group: scale 0, codes 0
    codes, scales = quantize_activations(x)
    assert activation_group() == GROUP
    amax = x.abs().view(5, 96 // GROUP, GROUP).amax(-1)  # a scale per GROUP values
    torch.testing.assert_close(scales, amax * (1 / 127), rtol=1e-6, atol=0)
    ratio = x.view(5, 96 // GROUP, GROUP) / scales.clamp_min(1e-30)[..., None]
    expected = torch.round(ratio).view(5, 96)
    near_half = ((ratio.view(5, 96).abs() % 1) - 0.5).abs() < 1e-4  # either rounding is right
    assert bool(((codes.float() == expected) | near_half).all())
    assert int(codes.abs().max()) == 127 and bool((codes[2, 32:48] == 0).all())


def test_every_build_quantizes_activations_to_the_same_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The 512-bit quantizer (sixteen values at a time) and the plain-C loop give the same codes
    and scales, ties, NaN, infinities, zeros and subnormal groups included."""
    builds = [b for b in _builds() if quant_int8.kernel_library(b) is not None]
    if len(builds) < 2:
        pytest.skip("one kernel build on this machine")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 256, generator=gen) * torch.logspace(-3, 3, 256)
    x[0, :32] = torch.arange(-16, 16) * 0.5  # halves: round-to-nearest-even ties
    x[1, 4:8] = float("nan")
    x[1, 8:12] = torch.tensor([float("inf"), 1.0, -2.0, 0.0])
    x[2, :64] = 0.0
    x[3, 16:20] = torch.tensor([1e-40, -3e-39, 0.0, 2e-45])  # d below the smallest normal
    x[4, 40:44] = torch.tensor([float("nan"), 3.0, -7.0, 0.25])
    results = []
    for build in builds:
        library = quant_int8.kernel_library(build)
        monkeypatch.setattr(quant_int8, "_library", lambda library=library: library)
        results.append(quantize_activations(x))
    for build, (codes, scales) in zip(builds[1:], results[1:]):
        assert torch.equal(codes, results[0][0]), build
        assert torch.equal(scales.view(torch.int32), results[0][1].view(torch.int32)), build


@pytest.mark.parametrize("qtype", sorted(INT8_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(qtype: GGMLQuantizationType,
                                                              build: str) -> None:
    """Batch invariance, every type and build: 1,030 rows in one call (several passes of x rows,
    weights unpacked ahead once per pass) give each row the bits it gets alone, in a call of 5
    (one tile of 4 and a tail), of 9 or 17 (AVX2: from 8 or 16 rows a group's codes are unpacked
    to bytes first) or of 1,024 rows (pass boundaries elsewhere)."""
    values, _ = GGML_QUANT_SIZES[qtype]
    weight, _ = _weight(qtype, 37, 3 * max(values, 32), seed=5)
    x = torch.randn(1030, weight.num_cols, generator=torch.Generator().manual_seed(6))
    kernel = Int8Weights([weight])
    whole = kernel(x)
    assert torch.equal(kernel(x[6:]), whole[6:])
    for start in (0, 3, 511, 1025):
        assert torch.equal(kernel(x[start:start + 1]), whole[start:start + 1]), start
        for rows in (5, 9, 17):
            assert torch.equal(kernel(x[start:start + rows]), whole[start:start + rows]), (start, rows)


@pytest.mark.parametrize("qtype", sorted(INT8_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_products_equal_linear_of_rounded_activations(qtype: GGMLQuantizationType, build: str) -> None:
    values, _ = GGML_QUANT_SIZES[qtype]
    unit = max(values, 32)
    for num_rows in (1, 3, 4, 5, 33):
        for num_out, num_cols in ((13, 3 * unit), (40, 6 * unit), (17, unit)):
            weight, dense = _weight(qtype, num_out, num_cols, seed=num_rows + num_out)
            x = torch.randn(num_rows, num_cols, generator=torch.Generator().manual_seed(num_out))
            got = Int8Weights([weight])(x)
            rounded, scale = _rounded(x)
            expected = F.linear(rounded.double(), dense.double())
            magnitude = F.linear(rounded.abs().double(), dense.abs().double())
            assert bool(((got.double() - expected).abs() <= 2e-6 * magnitude + 1e-6).all()), (
                qtype.name, num_rows, num_out, num_cols)
            # and against the exact activations: at most half a code per value
            bound = F.linear(scale.double() / 2, dense.abs().double())
            exact = F.linear(x.double(), dense.double())
            assert bool(((got.double() - exact).abs() <= bound * 1.001 + 1e-5).all())


def test_parts_of_mixed_types_write_consecutive_columns(build: str) -> None:
    parts = [_weight(t, n, 256, seed=i) for i, (t, n) in enumerate(
        [(T.Q4_K, 20), (T.Q8_0, 7), (T.Q4_1, 16), (T.Q6_K, 3)])]
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3))
    out = torch.full((6, 50), float("nan"))
    Int8Weights([w for w, _ in parts])(x, out[:, 2:48])
    rounded, _ = _rounded(x)
    expected = F.linear(rounded, torch.cat([d for _, d in parts]))
    torch.testing.assert_close(out[:, 2:48], expected, rtol=1e-5, atol=1e-4)
    assert bool(out[:, :2].isnan().all() and out[:, 48:].isnan().all())  # nothing outside


def test_fused_norm_gating_residual_and_rope_match_torch() -> None:
    gen = torch.Generator().manual_seed(4)
    weight, dense = _weight(T.Q4_0, 4 * 64, 128, seed=9)
    x = torch.randn(3, 128, generator=gen)
    norm = torch.rand(128, generator=gen) + 0.5
    got = Int8Weights([weight])(x, fused=Fused(norm=norm, eps=1e-5))
    _check_within_bound(got, F.rms_norm(x, (128,), norm, 1e-5), dense)

    gate_up = torch.randn(3, 256, generator=gen)
    got = Int8Weights([weight])(gate_up, fused=Fused(gated=True))
    _check_within_bound(got, F.silu(gate_up[:, :128]) * gate_up[:, 128:], dense)

    residual = torch.randn(3, 256, generator=gen)
    plain = Int8Weights([weight])(x)
    torch.testing.assert_close(Int8Weights([weight])(x, fused=Fused(residual=residual)),
                               plain + residual)

    positions = torch.tensor([0, 5, 700])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    angles = positions[:, None].float() * inv_freq  # [3, 32]
    cos, sin = angles.cos(), angles.sin()
    got = Int8Weights([weight])(x, fused=Fused(rope=(cos, sin, 3 * 64, 64)))
    rotated = apply_rotary(plain[:, : 3 * 64].view(3, 3, 64), cos[:, None], sin[:, None])
    torch.testing.assert_close(got[:, : 3 * 64], rotated.reshape(3, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, 3 * 64 :], plain[:, 3 * 64 :])  # the last head: no RoPE


def test_gemma_options_match_torch() -> None:
    """Gemma's folded ops: tanh-GELU gating, per-head q/k norms before RoPE, a norm of the
    product before the residual add; each against torch's own op on the kernel's plain output."""
    gen = torch.Generator().manual_seed(6)
    weight, dense = _weight(T.Q4_K, 4 * 64, 256, seed=9)
    gate_up = 3 * torch.randn(3, 512, generator=gen)  # tails of GELU's tanh too
    got = Int8Weights([weight])(gate_up, fused=Fused(gated=True, gelu=True))
    _check_within_bound(got, F.gelu(gate_up[:, :256], approximate="tanh") * gate_up[:, 256:], dense)

    x = torch.randn(3, 256, generator=gen)
    plain = Int8Weights([weight])(x)
    q_norm, k_norm = torch.rand(64, generator=gen) + 0.5, torch.rand(64, generator=gen) + 0.5
    positions = torch.tensor([0, 5, 700])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    angles = positions[:, None].float() * inv_freq
    cos, sin = angles.cos(), angles.sin()
    got = Int8Weights([weight])(x, fused=Fused(
        eps=1e-6, rope=(cos, sin, 3 * 64, 64), head_norms=(q_norm, k_norm, 2 * 64, 64)))
    heads = plain.view(3, 4, 64)
    normed = torch.cat([F.rms_norm(heads[:, :2], (64,), q_norm, 1e-6),
                        F.rms_norm(heads[:, 2:3], (64,), k_norm, 1e-6)], dim=1)
    rotated = apply_rotary(normed, cos[:, None], sin[:, None])
    torch.testing.assert_close(got[:, : 3 * 64], rotated.reshape(3, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, 3 * 64 :], plain[:, 3 * 64 :])  # v: untouched

    post = torch.rand(256, generator=gen) + 0.5
    residual = torch.randn(3, 256, generator=gen)
    got = Int8Weights([weight])(x, fused=Fused(eps=1e-6, post_norm=post, residual=residual))
    torch.testing.assert_close(got, residual + F.rms_norm(plain, (256,), post, 1e-6),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="head norms need rope's head_dim"):
        Int8Weights([weight])(x, fused=Fused(head_norms=(q_norm, k_norm, 64, 64)))
    with pytest.raises(ValueError, match=r"post_norm must be contiguous fp32 \[256\]"):
        Int8Weights([weight])(x, fused=Fused(post_norm=post[:128]))


def _check_within_bound(got: torch.Tensor, prepared: torch.Tensor, dense: torch.Tensor) -> None:
    """got = q8(prepared) . dense^T: within half a code per value of the exact product (the
    kernel prepares in another float order, so a code may round the other way)."""
    _, scale = _rounded(prepared)
    bound = F.linear(scale.double() / 2, dense.abs().double())
    exact = F.linear(prepared.double(), dense.double())
    assert bool(((got.double() - exact).abs() <= bound * 1.01 + 1e-4).all())


def test_mlp_block_is_attention_residual_then_gated_mlp() -> None:
    gen = torch.Generator().manual_seed(5)
    hidden_size, inter = 64, 96
    o_proj, o_dense = _weight(T.Q8_0, hidden_size, 64, seed=1)
    gate, gate_dense = _weight(T.Q4_1, inter, hidden_size, seed=2)
    up, up_dense = _weight(T.Q5_0, inter, hidden_size, seed=3)
    down, down_dense = _weight(T.Q8_0, hidden_size, inter, seed=4)
    attn, hidden = torch.randn(2, 64, generator=gen), torch.randn(2, hidden_size, generator=gen)
    norm = torch.rand(hidden_size, generator=gen) + 0.5
    got = mlp_block(attn, hidden, Int8Weights([o_proj]), norm, 1e-6,
                    Int8Weights([gate, up]), Int8Weights([down]))
    h = hidden + F.linear(attn, o_dense)
    normed = F.rms_norm(h, (hidden_size,), norm, 1e-6)
    expected = h + F.linear(F.silu(F.linear(normed, gate_dense)) * F.linear(normed, up_dense),
                            down_dense)
    # three int8 roundings in a row (random weights make large outputs): a few percent of the
    # output's scale, far below a wiring error (gate and up swapped moves it by tens of percent)
    torch.testing.assert_close(got, expected, rtol=0, atol=0.03 * float(expected.abs().max()))
    # and exactly the three fused products it chains
    h_kernel = Int8Weights([o_proj])(attn, fused=Fused(residual=hidden))
    gate_up = Int8Weights([gate, up])(h_kernel, fused=Fused(norm=norm, eps=1e-6))
    chained = Int8Weights([down])(gate_up, fused=Fused(gated=True, residual=h_kernel))
    torch.testing.assert_close(got, chained, rtol=0, atol=0)


def test_mlp_block_takes_gemmas_post_norms_and_gelu() -> None:
    gen = torch.Generator().manual_seed(7)
    hidden_size, inter = 64, 96
    o_proj, o_dense = _weight(T.Q8_0, hidden_size, 64, seed=1)
    gate, gate_dense = _weight(T.Q5_1, inter, hidden_size, seed=2)
    up, up_dense = _weight(T.Q4_0, inter, hidden_size, seed=3)
    down, down_dense = _weight(T.Q8_0, hidden_size, inter, seed=4)
    attn, hidden = torch.randn(2, 64, generator=gen), torch.randn(2, hidden_size, generator=gen)
    norm, post_o, post_mlp = (torch.rand(hidden_size, generator=gen) + 0.5 for _ in range(3))
    got = mlp_block(attn, hidden, Int8Weights([o_proj]), norm, 1e-6, Int8Weights([gate, up]),
                    Int8Weights([down]), post_norms=(post_o, post_mlp), gelu=True)
    h = hidden + F.rms_norm(F.linear(attn, o_dense), (hidden_size,), post_o, 1e-6)
    normed = F.rms_norm(h, (hidden_size,), norm, 1e-6)
    act = F.gelu(F.linear(normed, gate_dense), approximate="tanh") * F.linear(normed, up_dense)
    expected = h + F.rms_norm(F.linear(act, down_dense), (hidden_size,), post_mlp, 1e-6)
    torch.testing.assert_close(got, expected, rtol=0, atol=0.03 * float(expected.abs().max()))
    h_kernel = Int8Weights([o_proj])(attn, fused=Fused(eps=1e-6, post_norm=post_o, residual=hidden))
    gate_up = Int8Weights([gate, up])(h_kernel, fused=Fused(norm=norm, eps=1e-6))
    chained = Int8Weights([down])(gate_up, fused=Fused(
        gated=True, gelu=True, eps=1e-6, post_norm=post_mlp, residual=h_kernel))
    torch.testing.assert_close(got, chained, rtol=0, atol=0)


def test_bad_weights_and_shapes_are_clear_errors() -> None:
    f16, _ = _weight(T.F16, 4, 64, seed=0)
    with pytest.raises(ValueError, match=r"'w.F16'.*does not read F16.*reads Q4_0"):
        Int8Weights([f16])
    a, _ = _weight(T.Q4_0, 4, 64, seed=0)
    b, _ = _weight(T.Q4_0, 4, 96, seed=0)
    with pytest.raises(ValueError, match="one call needs one K"):
        Int8Weights([a, b])
    with pytest.raises(ValueError, match=r"x must be fp32 \[M, 64\]"):
        Int8Weights([a])(torch.zeros(2, 96))
    with pytest.raises(ValueError, match=r"residual must be fp32 \[2, 4\]"):
        Int8Weights([a])(torch.zeros(2, 64), fused=Fused(residual=torch.zeros(2, 5)))


def test_the_residual_must_not_be_the_output() -> None:
    weight, _ = _weight(T.Q4_0, 4, 64, seed=0)
    out = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="must not share memory with the output"):
        Int8Weights([weight])(torch.zeros(2, 64), out, fused=Fused(residual=out))


def test_repacking_drops_only_file_pages_and_loses_no_byte(tmp_path) -> None:
    """After repacking, a weight's bytes read back unchanged whether they live in memory (left
    alone: dropping anonymous pages would zero them) or in a read-only file mapping (dropped from
    the process, read again from the file when touched)."""
    raw = random_blocks(T.Q4_1, 64, 4096, seed=11)  # 80 KiB: whole pages inside
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    for source in (raw.copy(), mapped):
        weight = QuantizedWeight.from_numpy("w", T.Q4_1, source)
        before = weight.data.clone()
        Int8Weights([weight])
        assert torch.equal(weight.data, before)
    assert QuantizedWeight.from_numpy("w", T.Q4_1, mapped).file_mapped
    assert not QuantizedWeight.from_numpy("w", T.Q4_1, raw).file_mapped
    writable = np.memmap(path, dtype=np.uint8, mode="c", shape=raw.shape)  # copy-on-write
    assert not QuantizedWeight.from_numpy("w", T.Q4_1, writable).file_mapped
    with open(path, "rb") as f:
        read_only = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # as the GGUF reader maps
        copy_on_write = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for m, expected in ((read_only, True), (copy_on_write, False)):
        view = np.frombuffer(m, dtype=np.uint8).reshape(raw.shape)
        assert QuantizedWeight.from_numpy("w", T.Q4_1, view).file_mapped is expected


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_repacking_chunk_by_chunk_gives_the_whole_weights_bytes(
        build: str, qtype: GGMLQuantizationType, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight repacked a few 16-row groups at a time (the source's file pages dropped after
    each) holds the same bytes as one repacked in one call, tail group included; and the file's
    bytes read back unchanged."""
    raw = random_blocks(qtype, 16 * 9 + 5, 256, seed=14)  # 9 whole groups and a tail of 5 rows
    path = tmp_path / "w.bin"
    raw.tofile(path)
    whole = quant_int8.repacked(QuantizedWeight.from_numpy("w", qtype, raw.copy()))
    if whole is None:
        pytest.skip(f"the {build} build does not repack {qtype.name}")
    row_bytes = raw.reshape(raw.shape[0], -1).shape[1]
    monkeypatch.setattr(quant_int8, "REPACK_CHUNK_BYTES", 3 * 16 * row_bytes)  # 3 groups a call
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    weight = QuantizedWeight.from_numpy("w", qtype, mapped)
    assert weight.file_mapped
    chunked = quant_int8.repacked(weight)
    assert chunked is not None and torch.equal(chunked, whole)
    assert torch.equal(weight.data, torch.from_numpy(raw.reshape(raw.shape[0], -1).copy()))


def test_a_scale_beyond_the_repacked_layout_is_read_as_it_is(build: str) -> None:
    """A Q4_0 scale whose offset (-8 d) leaves fp16 cannot be repacked: that weight keeps the
    row kernel and its products stay the reference's."""
    raw = random_blocks(T.Q4_0, 20, 64, seed=12)
    raw.view(np.uint8).reshape(20, -1)[3, 0:2] = np.frombuffer(
        np.float16(10000.0).tobytes(), dtype=np.uint8)  # row 3's first block: d = 10,000
    weight = QuantizedWeight.from_numpy("w", T.Q4_0, raw)
    dense = torch.from_numpy(dequantize(raw, T.Q4_0).astype(np.float32))
    kernel = Int8Weights([weight])
    assert kernel.packed == [None]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(13))
    rounded, _ = _rounded(x)
    expected = F.linear(rounded.double(), dense.double())
    magnitude = F.linear(rounded.abs().double(), dense.abs().double())
    assert bool(((kernel(x).double() - expected).abs() <= 2e-6 * magnitude + 1e-6).all())


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_a_weight_repacked_by_one_build_is_repacked_for_another(
        qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Builds for other targets lay codes out differently (AVX2's bit planes, its signed Q8_0
    codes): a weight repacked by one build and then read by another holds the second build's
    layout, and its products there equal the reference."""
    raw = random_blocks(qtype, 40, 256, seed=21)
    dense = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(22))
    builds = _builds()
    for first, second in zip(builds, builds[1:] + builds[:1]):
        libraries = [quant_int8.kernel_library(b) for b in (first, second)]
        if None in libraries:
            continue
        weight = QuantizedWeight.from_numpy("w", qtype, raw.copy())
        monkeypatch.setattr(quant_int8, "_library", lambda: libraries[0])
        quant_int8.repacked(weight)
        monkeypatch.setattr(quant_int8, "_library", lambda: libraries[1])
        alone = quant_int8.repacked(QuantizedWeight.from_numpy("w", qtype, raw.copy()))
        again = quant_int8.repacked(weight)
        assert (again is None) == (alone is None), (first, second)
        assert again is None or torch.equal(again, alone), (first, second)
        x_rounded, _ = _rounded(x)
        expected = F.linear(x_rounded, dense)
        got = Int8Weights([weight])(x)
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-3), (first, second)
