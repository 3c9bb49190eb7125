"""A dense Llama model's forward with its small ops in C (kernels/layer_ops.c).

Invariant: computes what LlamaForCausalLM.forward computes through DecoderLayer.forward, with the
same Linears and attention, only in another order of float operations: the residual add and the
RMSNorm after it are one call, RoPE is one call in place on q/k (so q, k and v stay views of
the qkv product, which also lets attention fold a decode step's K/V write into its kernel), and
silu(gate) * up is one call; each computes in fp32 and rounds once to the compute dtype (in
bf16, torch's path rounds RoPE's products to bf16 with bf16 cos/sin: K differs by a bf16 ulp).
Why: a decode step's ~20 small torch ops per layer (norms, casts, RoPE's eight, adds, the
activation) each cost microseconds of dispatch for nanoseconds of work, about a quarter of a
32-sequence decode step of SmolLM2 in bf16; in a prefill they are memory passes and casts
(W1 in bf16: its two prefill steps 10-13% faster with them in C). Only plain DecoderLayers (no
per-head norms, SiLU, RMSNorm with fp32 weights) in fp32 or bf16 on CPU take this path (fits);
every other model runs DecoderLayer.forward.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from kvmemo.model.layers import RMSNorm
from kvmemo.native import load_library

if TYPE_CHECKING:
    from kvmemo.model.llama import AttentionFn, DecoderLayer, LlamaForCausalLM

SOURCE = Path(__file__).with_name("kernels") / "layer_ops.c"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_COLS = 16384  # layer_ops.c's row scratch

_p, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


@cache
def _library() -> ctypes.CDLL | None:
    library = load_library(SOURCE, "the model's small ops run through torch")
    if library is None:
        return None
    library.kvmemo_add_rmsnorm.argtypes = [_p, _i64, _i64, _p, _i32, _i64, _p, ctypes.c_float,
                                           _p, _i32]
    library.kvmemo_rope.argtypes = [_p, _i32, _i64, _i64, _i64, _i64, _p, _p]
    library.kvmemo_silu_mul.argtypes = [_p, _i64, _p, _i64, _i32, _i64, _i64, _p]
    for fn in (library.kvmemo_add_rmsnorm, library.kvmemo_rope, library.kvmemo_silu_mul):
        fn.restype = ctypes.c_int
    return library


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ValueError(f"layer_ops.{what}: unsupported dtype or width (fits() admits neither)")


def add_rmsnorm(hidden: torch.Tensor, addend: torch.Tensor | None, weight: torch.Tensor,
                eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """hidden [T, C] fp32 contiguous += addend [T, C] (rows with unit stride, fp32 or bf16) in
    place; returns rms_norm(hidden) * weight [T, C] in out_dtype."""
    library = cast(ctypes.CDLL, _library())
    rows, cols = hidden.shape
    out = torch.empty(rows, cols, dtype=out_dtype)
    add_ptr, add_code, add_ld = None, 0, 0
    if addend is not None:
        add_ptr, add_code, add_ld = addend.data_ptr(), DTYPE_CODES[addend.dtype], addend.stride(0)
    _check(library.kvmemo_add_rmsnorm(hidden.data_ptr(), rows, cols, add_ptr, add_code, add_ld,
                                      weight.data_ptr(), eps, out.data_ptr(),
                                      DTYPE_CODES[out_dtype]), "add_rmsnorm")
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_cols: int,
          head_dim: int) -> None:
    """Rotate-half RoPE in place on x [T, N]'s first rope_cols columns; cos/sin fp32 [T, D/2]
    contiguous."""
    library = cast(ctypes.CDLL, _library())
    _check(library.kvmemo_rope(x.data_ptr(), DTYPE_CODES[x.dtype], x.shape[0], x.stride(0),
                               rope_cols, head_dim, cos.data_ptr(), sin.data_ptr()), "rope")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] rows with unit stride, one dtype; a new contiguous tensor."""
    library = cast(ctypes.CDLL, _library())
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=gate.dtype)
    _check(library.kvmemo_silu_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
                                   DTYPE_CODES[gate.dtype], rows, cols, out.data_ptr()),
           "silu_mul")
    return out


class DenseForward:
    """embed -> [add + norm -> qkv -> RoPE -> attention -> o -> add + norm -> gate, up -> silu *
    up -> down] x layers -> add + final norm, for one LlamaForCausalLM with dense weights."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.layers = cast("list[DecoderLayer]", list(model.layers))
        first = self.layers[0]
        self.dtype = model.compute_dtype
        self.q_size, self.kv_size, self.head_dim = first.q_size, first.kv_size, first.head_dim
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_kv_heads
        self.norms = [(_weight(layer.input_layernorm), _weight(layer.post_attention_layernorm))
                      for layer in self.layers]
        self.eps = float(cast(RMSNorm, first.input_layernorm).eps)
        self.final_norm = _weight(model.norm)
        self.final_eps = float(cast(RMSNorm, model.norm).eps)

    @staticmethod
    def fits(model: LlamaForCausalLM) -> bool:
        from kvmemo.model.llama import DecoderLayer

        layers = cast("list[DecoderLayer]", list(model.layers))
        norms: list[torch.nn.Module] = [model.norm] + [
            n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        return (
            _library() is not None
            and model.compute_dtype in DTYPE_CODES
            and not model.native_parts
            and model.embed_tokens.weight.device.type == "cpu"
            and all(type(layer) is DecoderLayer and layer.mlp.activation == "silu"
                    and layer.mlp.gate_up is None and layer.fused_step is None
                    for layer in layers)
            and all(type(n) is RMSNorm for n in norms)
            and all(n.weight.dtype == torch.float32 and n.eps == cast(RMSNorm, norms[0]).eps
                    for n in cast("list[RMSNorm]", norms))
            and model.config.hidden_size <= MAX_COLS
            and model.config.intermediate_size <= MAX_COLS
            and (layers[0].num_heads + layers[0].num_kv_heads) * layers[0].head_dim <= MAX_COLS
        )

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 attention: AttentionFn) -> torch.Tensor:
        """hidden [T, C] fp32 embeddings (not modified) -> the final-normed hidden [T, C] fp32."""
        stream = hidden.contiguous().clone()  # the residual stream, updated in place
        tokens = stream.shape[0]
        cos, sin = self.model.rotary.cos_sin(positions, torch.float32)  # [T, 1, D/2] each
        cos, sin = cos.reshape(tokens, -1).contiguous(), sin.reshape(tokens, -1).contiguous()
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        pending: torch.Tensor | None = None  # the previous layer's MLP output, not yet added
        for index, layer in enumerate(self.layers):
            input_norm, mlp_norm = self.norms[index]
            normed = add_rmsnorm(stream, pending, input_norm, self.eps, self.dtype)
            qkv = layer.qkv(normed)  # [T, (H + 2 KV) * D]
            rope_(qkv, cos, sin, k_end, self.head_dim)
            q = qkv[:, :q_end].view(tokens, self.num_heads, self.head_dim)
            k = qkv[:, q_end:k_end].view(tokens, self.num_kv_heads, self.head_dim)
            v = qkv[:, k_end:].view(tokens, self.num_kv_heads, self.head_dim)
            out = attention(index, q, k, v)  # [T, H, D]
            attended = layer.o(out.reshape(tokens, self.q_size))
            normed = add_rmsnorm(stream, attended, mlp_norm, self.eps, self.dtype)
            mlp = layer.mlp
            pending = mlp.down(silu_mul(mlp.gate(normed), mlp.up(normed)))
        return add_rmsnorm(stream, pending, self.final_norm, self.final_eps, torch.float32)


def _weight(norm: torch.nn.Module) -> torch.Tensor:
    return cast(RMSNorm, norm).weight.detach().contiguous()


def kernel_available() -> bool:
    """layer_ops.c built and loaded here."""
    return _library() is not None

