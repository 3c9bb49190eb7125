"""Products of activations quantized to int8 (any row count) with GGUF-quantized weights.

Invariant: Int8Weights([w])(x) equals F.linear(x', w.dequantize()) to fp32 rounding, where x' is
x rounded to int8 codes per group of 16 values (the C file's GROUP; scale amax / 127:
quantize_activations), so it differs from F.linear(x, W) by at most sum_k |W[n, k]| * scale_k / 2
(kernels/quant_int8.c).
Why: the integer dot product of 32 codes is one VNNI instruction (AVX512-VNNI, AVX-VNNI; two on
AVX2), where the fp32-activation kernel (quant_linear.py) dequantizes each weight block to floats
first. Weights repacked at load into groups of 16 rows (kernels/q8_repacked.h; a Q4_0/Q4_1
weight keeps the file's bytes per value) make a vector's lanes outputs, so no run is unpacked
twice and no lane is summed across. A decode step reads every weight once; this is what llama.cpp
does on CPU (with a scale per 32 values; per 16 lets a group's four dots add in int32 before
one scale, 1.4x the rate of a scale per 4, see docs/benchmarks.md). The fp32-activation kernel
stays for F16/BF16 weights.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable

import torch
from gguf import GGMLQuantizationType

from kvmemo.file_pages import drop_resident_pages
from kvmemo.huge_pages import huge_page_empty
from kvmemo.model.kernels.quant_linear import QuantizedWeight
from kvmemo.native import load_library

SOURCE = Path(__file__).with_name("quant_int8.c")
T = GGMLQuantizationType
INT8_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})
BLOCK = 32  # values per weight run (the kernel's unit; K must be a multiple)

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class _Library:
    quantize: Callable[..., int]
    linear: Callable[..., int]
    mlp_block: Callable[..., int]
    repacked_bytes: Callable[..., int]
    repack: Callable[..., int]
    group: int  # activation values per int8 scale: the kernel's GROUP, stated there only


@cache
def kernel_library(march: str = "native") -> _Library | None:
    """The kernel built for this CPU (or for `march`: tests run the AVX2 and plain-C paths of an
    AVX-512 machine through "x86-64-v3" and "x86-64"), or None without a C compiler."""
    library = load_library(SOURCE, "quantized weights use the fp32-activation kernel instead",
                           march)
    if library is None:
        return None
    quantize = library.kvmemo_quantize_q8
    quantize.restype = ctypes.c_int
    quantize.argtypes = [_p, _i64, _i64, _i64, _p, _p]
    linear = library.kvmemo_quant_linear_q8
    linear.restype = ctypes.c_int
    linear.argtypes = [_p, _i64, _i64, _p, _p, _i64, _p]
    mlp_block = library.kvmemo_q8_mlp_block
    mlp_block.restype = ctypes.c_int
    mlp_block.argtypes = [_p, _i64, _p, _i64, _i64, _p, _p, ctypes.c_float, _p, _p, _p, _i64,
                          _p, _p, ctypes.c_int32]
    repacked_bytes = library.kvmemo_q8_repacked_bytes
    repacked_bytes.restype = _i64
    repacked_bytes.argtypes = [ctypes.c_int, _i64, _i64]
    repack = library.kvmemo_q8_repack
    repack.restype = ctypes.c_int
    repack.argtypes = [ctypes.c_int, _p, _i64, _i64, _i64, _p]
    library.kvmemo_q8_group.restype = ctypes.c_int
    return _Library(quantize, linear, mlp_block, repacked_bytes, repack,
                    int(library.kvmemo_q8_group()))


MAX_PARTS = 8  # the kernel's limit of weights per product


class WeightsStruct(ctypes.Structure):
    """The C kernel's q8_weights (kernels/q8_api.h)."""

    _fields_ = [
        ("num_parts", _i64), ("K", _i64), ("W", _p * MAX_PARTS),
        ("types", ctypes.c_int32 * MAX_PARTS), ("N", _i64 * MAX_PARTS),
        ("packed", _p * MAX_PARTS),
    ]


class OptionsStruct(ctypes.Structure):
    """The C kernel's q8_options (kernels/q8_api.h)."""

    _fields_ = [
        ("norm", _p), ("eps", ctypes.c_float), ("gated", ctypes.c_int32),
        ("residual", _p), ("ldr", _i64), ("cos", _p), ("sin", _p),
        ("rope_cols", _i64), ("head_dim", _i64), ("gelu", ctypes.c_int32),
        ("q_norm", _p), ("k_norm", _p), ("q_cols", _i64), ("k_cols", _i64), ("post_norm", _p),
    ]


@dataclass(frozen=True)
class Fused:
    """Work folded into one Int8Weights call (a decode step's small ops, see the C options).

    norm: RMSNorm each x row first (x * rsqrt(mean(x^2) + eps) * norm), fp32 [K]; eps is every
    norm's of the call.
    gated: x rows are [gate | up] (2K wide) and the input is act(gate) * up, act SiLU, or
    tanh-GELU where gelu.
    head_norms: (q_norm, k_norm fp32 [head_dim], q_cols, k_cols): RMSNorm of each head of the
    output's first q_cols columns and of the next k_cols (Gemma's), before RoPE; needs rope.
    rope: (cos, sin [M, D/2] fp32 contiguous, columns, head_dim): rotate-half RoPE over the
    output's first `columns` columns.
    post_norm: RMSNorm of each output row, fp32 [N], before the residual add (Gemma's).
    residual: the output is residual + product (residual [M, N] fp32, not the output itself:
    the product is written before the residual is added).
    """

    norm: torch.Tensor | None = None
    eps: float = 0.0
    gated: bool = False
    gelu: bool = False
    head_norms: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
    rope: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
    post_norm: torch.Tensor | None = None
    residual: torch.Tensor | None = None


def _library() -> _Library | None:
    return kernel_library()


def int8_kernel_available() -> bool:
    return _library() is not None


def reads(weight: QuantizedWeight) -> bool:
    """This kernel serves the weight (its type, and a built kernel)."""
    return weight.qtype in INT8_TYPES and _library() is not None


# A weight's repacked copy, made once however many Int8Weights read it (the model's layers and a
# test's reference may share a QuantizedWeight); it lives as long as the weight. Kept with the
# build that made it: builds for other targets lay codes out differently (AVX2's bit planes and
# signed Q8_0 codes), so a weight read by another build (a test's x86-64-v3 pass on an AVX-512
# machine) is repacked for it.
_REPACKED: weakref.WeakKeyDictionary[QuantizedWeight, tuple[_Library, torch.Tensor | None]] = (
    weakref.WeakKeyDictionary())


# Source bytes repacked per call. Why: repacking touches every page of the GGUF bytes, and a
# file-mapped weight's pages stay resident until paged out; chunk by chunk, at most this much of
# them is resident beside the copy (whole, Gemma 3's 170 MB Q8_0 embedding was held twice: its
# start's peak RSS was 170 MB above what it keeps).
REPACK_CHUNK_BYTES = 16 * 2**20
PACK_ROWS = 16  # rows per repacked group (kernels/q8_repacked.h): a chunk holds whole groups


def repacked(weight: QuantizedWeight) -> torch.Tensor | None:
    """The weight in the layout of the kernel's 16-row groups (kernels/q8_repacked.h), or None
    where this CPU's build has no such kernel (then the GGUF bytes are read as they are)."""
    lib = _require()
    cached = _REPACKED.get(weight)
    if cached is not None and cached[0] is lib:
        return cached[1]
    rows, qtype, cols = weight.shape[0], int(weight.qtype), weight.num_cols
    size = lib.repacked_bytes(qtype, rows, cols)
    if size == 0:
        return None
    out = huge_page_empty(size)  # 64-byte aligned, on 2 MiB pages: every step streams it
    row_bytes = weight.data.shape[1]
    chunk = max(PACK_ROWS, REPACK_CHUNK_BYTES // row_bytes // PACK_ROWS * PACK_ROWS)
    packed: torch.Tensor | None = out
    for first in range(0, rows, chunk):  # groups are laid out one after another
        count = min(chunk, rows - first)
        source = weight.data[first : first + count]
        status = lib.repack(qtype, source.data_ptr(), row_bytes, count, cols,
                            out.data_ptr() + lib.repacked_bytes(qtype, first, cols))
        assert status in (0, 2), f"q8_repack status {status}"
        if weight.file_mapped:
            _page_out(source)
        if status == 2:  # a scale beyond fp16's range: the weight is read as it is
            packed = None
            break
    _REPACKED[weight] = (lib, packed)
    if packed is not None and weight.file_mapped:
        _page_out(weight.data)  # the pages that straddled two chunks
    return packed


def _page_out(data: torch.Tensor) -> None:
    """Drops a repacked weight's GGUF bytes, pages of a file mapped read-only
    (QuantizedWeight.file_mapped), from this process's resident memory: the products read the
    repacked copy, so these would stay resident beside it (the repack touched them all). They
    stay in the page cache (the next start reads them from memory, not disk) and come back if
    anything touches them (the embedding table's rows)."""
    start = data.data_ptr()
    drop_resident_pages(start, start + data.numel() * data.element_size())


class Int8Weights:
    """Quantized weights [N_p, K] that one kernel call multiplies, writing consecutive column
    ranges of one output (a fused q/k/v or gate/up, which may mix GGUF types). Where this CPU's
    build has the repacked kernel (AVX2 and up), the weights are repacked for it here, once,
    and every row count takes it; elsewhere (plain x86-64) the kernel reads the GGUF bytes as
    they are."""

    def __init__(self, weights: Sequence[QuantizedWeight]) -> None:
        if not 1 <= len(weights) <= MAX_PARTS:
            raise ValueError(f"1 to {MAX_PARTS} weights per call, got {len(weights)}")
        for w in weights:
            if w.qtype not in INT8_TYPES:
                supported = ", ".join(sorted(t.name for t in INT8_TYPES))
                raise ValueError(f"tensor {w.name!r}: the int8 kernel does not read "
                                 f"{w.qtype.name}; it reads {supported}")
            if w.num_cols != weights[0].num_cols:
                raise ValueError(f"tensor {w.name!r} has {w.num_cols} columns, "
                                 f"{weights[0].name!r} {weights[0].num_cols}: one call needs one K")
        if weights[0].num_cols % BLOCK:
            raise ValueError(f"tensor {weights[0].name!r}: K={weights[0].num_cols} is not a "
                             f"multiple of {BLOCK}")
        self.weights = tuple(weights)  # keeps the bytes the pointers below point into alive
        self.num_cols = weights[0].num_cols
        self.num_out = sum(w.shape[0] for w in weights)
        self.struct = WeightsStruct(num_parts=len(weights), K=self.num_cols)
        self.packed = [repacked(w) for w in weights]
        for i, w in enumerate(weights):
            self.struct.W[i] = w.data.data_ptr()
            self.struct.types[i] = int(w.qtype)
            self.struct.N[i] = w.shape[0]
            packed = self.packed[i]
            self.struct.packed[i] = None if packed is None else packed.data_ptr()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 fused: Fused | None = None) -> torch.Tensor:
        """x [M, K] fp32 (CPU, unit column stride; [M, 2K] when fused.gated) -> q8(x) . W^T
        [M, N] fp32 (or into `out`, [M, N] with unit column stride, e.g. a column slice of a
        wider output)."""
        lib = _require()
        width = self.num_cols * (2 if fused is not None and fused.gated else 1)
        if x.dim() != 2 or x.shape[1] != width or x.dtype != torch.float32:
            raise ValueError(f"x must be fp32 [M, {width}] for "
                             f"{self.weights[0].name!r}, got {x.dtype} {tuple(x.shape)}")
        x = x if x.stride(1) == 1 else x.contiguous()
        rows = x.shape[0]
        if out is None:
            out = torch.empty(rows, self.num_out, dtype=torch.float32)
        if out.dtype != torch.float32 or out.stride(1) != 1 or out.shape != (rows, self.num_out):
            raise ValueError("out must be fp32 [M, N] with unit column stride")
        options = None if fused is None else self._options(fused, rows, out)
        status = lib.linear(
            x.data_ptr(), rows, x.stride(0), ctypes.byref(self.struct), out.data_ptr(),
            out.stride(0), None if options is None else ctypes.byref(options),
        )
        if status == 3:
            raise MemoryError("int8 kernel: no memory for the quantized activations")
        assert status == 0, f"quant_linear_q8 status {status}"
        return out

    def step_options(self, fused: Fused) -> OptionsStruct:
        """The options of a call folding `fused` in, checked as a call's are, for a caller in C
        that supplies each step's RoPE tables itself (layer_chain.c): cos and sin are left
        NULL. `fused` has rope (any one-row tables) and no residual."""
        if fused.rope is None or fused.residual is not None:
            raise ValueError("step options fold RoPE in and no residual")
        options = self._options(fused, 1, torch.empty(1, self.num_out))
        options.cos = options.sin = None
        return options

    def _options(self, fused: Fused, rows: int, out: torch.Tensor) -> OptionsStruct:
        options = OptionsStruct(eps=fused.eps, gated=int(fused.gated), gelu=int(fused.gelu))
        for name, norm, size in (("norm", fused.norm, self.num_cols),
                                 ("post_norm", fused.post_norm, self.num_out)):
            if norm is not None:
                setattr(options, name, _vector(name, norm, size))
        if fused.residual is not None:
            residual = fused.residual
            if (residual.dtype != torch.float32 or residual.shape != (rows, self.num_out)
                    or residual.stride(1) != 1):
                raise ValueError(f"residual must be fp32 [{rows}, {self.num_out}], unit stride")
            if residual.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
                raise ValueError("residual must not share memory with the output")
            options.residual, options.ldr = residual.data_ptr(), residual.stride(0)
        if fused.rope is not None:
            cos, sin, columns, head_dim = fused.rope
            for t in (cos, sin):
                if t.dtype != torch.float32 or t.shape != (rows, head_dim // 2) or (
                        not t.is_contiguous()):
                    raise ValueError(f"rope cos/sin must be contiguous fp32 [{rows}, "
                                     f"{head_dim // 2}]")
            if columns % head_dim or columns > self.num_out:
                raise ValueError(f"rope columns {columns}: whole heads of {head_dim} within "
                                 f"{self.num_out}")
            options.cos, options.sin = cos.data_ptr(), sin.data_ptr()
            options.rope_cols, options.head_dim = columns, head_dim
        if fused.head_norms is not None:
            q_norm, k_norm, q_cols, k_cols = fused.head_norms
            head_dim = options.head_dim
            if not head_dim or q_cols % head_dim or k_cols % head_dim or (
                    q_cols + k_cols > self.num_out):
                raise ValueError(f"head norms need rope's head_dim and whole heads within "
                                 f"{self.num_out} columns, got {q_cols} + {k_cols}")
            options.q_norm = _vector("head norms", q_norm, head_dim)
            options.k_norm = _vector("head norms", k_norm, head_dim)
            options.q_cols, options.k_cols = q_cols, k_cols
        return options


def _vector(name: str, t: torch.Tensor, size: int) -> int:
    """The address of a norm's weights, checked to be contiguous fp32 [size]."""
    if t.dtype != torch.float32 or t.shape != (size,) or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous fp32 [{size}]")
    return t.data_ptr()


def mlp_block(attn: torch.Tensor, hidden: torch.Tensor, o_proj: Int8Weights,
              norm: torch.Tensor, eps: float, gate_up: Int8Weights, down: Int8Weights,
              post_norms: tuple[torch.Tensor, torch.Tensor] | None = None, gelu: bool = False,
              ) -> torch.Tensor:
    """A decoder layer after attention in one call: h = hidden + post_o(o_proj(attn)), then
    h + post_mlp(down(act(gate) * up)) with [gate | up] = gate_up(rmsnorm(h) * norm). attn
    [M, q_size], hidden [M, H] fp32 with unit column stride; gate_up has exactly two parts
    (gate, up). A Llama layer: no post norms, act SiLU; a Gemma one: post_norms (post_o,
    post_mlp: contiguous fp32 [H]), act tanh-GELU (gelu)."""
    lib = _require()
    rows = hidden.shape[0]
    if len(gate_up.weights) != 2 or len(o_proj.weights) != 1 or len(down.weights) != 1:
        raise ValueError("mlp_block takes one o_proj and down weight and two gate/up weights")
    for t, cols in ((attn, o_proj.num_cols), (hidden, o_proj.num_out)):
        if t.dtype != torch.float32 or t.shape != (rows, cols) or t.stride(1) != 1:
            raise ValueError(f"expected fp32 [{rows}, {cols}] with unit column stride, got "
                             f"{t.dtype} {tuple(t.shape)}")
    post_o, post_mlp = (None, None) if post_norms is None else (
        _vector("post norms", post, o_proj.num_out) for post in post_norms)
    out = torch.empty(rows, down.num_out, dtype=torch.float32)
    status = lib.mlp_block(
        attn.data_ptr(), attn.stride(0), hidden.data_ptr(), hidden.stride(0), rows,
        ctypes.byref(o_proj.struct), norm.data_ptr(), eps, ctypes.byref(gate_up.struct),
        ctypes.byref(down.struct), out.data_ptr(), out.stride(0), post_o, post_mlp, int(gelu),
    )
    if status == 3:
        raise MemoryError("int8 kernel: no memory for the MLP block's intermediates")
    assert status == 0, f"q8_mlp_block status {status}"
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32, K a multiple of 32 -> (codes int8 [M, K], scales fp32 [M, K/group]):
    the quantization the kernel applies (what the product's error bound is stated against),
    with activation_group() values per scale."""
    lib = _require()
    group = lib.group
    if x.dim() != 2 or x.shape[1] % BLOCK or x.dtype != torch.float32:
        raise ValueError(f"x must be fp32 [M, K] with K a multiple of {BLOCK}, got "
                         f"{x.dtype} {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    rows, cols = x.shape
    codes = torch.empty(rows, cols, dtype=torch.int8)
    lanes = group // 4  # the kernel's layout: a scale per lane of 4 codes
    layout = torch.empty(rows, 2, cols // BLOCK, BLOCK // group, lanes, dtype=torch.float32)
    status = lib.quantize(
        x.data_ptr(), rows, cols, x.stride(0), codes.data_ptr(), layout.data_ptr()
    )
    assert status == 0, f"quantize_q8 status {status}"
    return codes, layout[:, 0, :, :, 0].reshape(rows, cols // group)


def activation_group() -> int:
    """Activation values per int8 scale (the built kernel's GROUP)."""
    return _require().group


def _require() -> _Library:
    lib = _library()
    if lib is None:
        raise RuntimeError("the int8-activation kernel could not be built (no C compiler?)")
    return lib
