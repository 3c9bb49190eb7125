"""The Llama family's fast paths, bound from outside the model class: a dense model's forward with
its small ops in C (DenseForward), and native weights' layer step in two int8-kernel calls
(FusedLayerStep; GemmaFusedLayerStep for Gemma 3's block). `prepare(model)` binds the model's
kernels, then whichever path fits.

Invariant: each computes what LlamaForCausalLM.forward computes through DecoderLayer.forward,
with the same Linears and attention, only in another order of float operations; a model no path
fits (a dense Gemma, CUDA, fp16, no C compiler) runs DecoderLayer.forward. llama.py never
imports this module: the model holds whatever is bound here behind the FastForward and
FastLayerStep protocols of layers/basic.py.

DenseForward: the residual add and the RMSNorm after it are one call, RoPE is one call in place on
q/k (so q, k and v stay views of the qkv product, which also lets attention fold a decode step's
K/V write into its kernel), and silu(gate) * up is one call; each computes in fp32 and rounds once
to the compute dtype (in bf16, torch's path rounds RoPE's products to bf16 with bf16 cos/sin: K
differs by a bf16 ulp). Why: a decode step's ~20 small torch ops per layer (norms, casts, RoPE's
eight, adds, the activation) each cost microseconds of dispatch for nanoseconds of work, about a
quarter of a 32-sequence decode step of SmolLM2 in bf16; in a prefill they are memory passes and
casts (W1 in bf16: its two prefill steps 10-13% faster with them in C). Only plain DecoderLayers
(no per-head norms, SiLU, RMSNorm with fp32 weights) in fp32 or bf16 on CPU take it (fits).

FusedLayerStep: each small op is folded into the int8 kernel call next to it (quant_int8.Fused):
norm, q/k/v and RoPE in one call; attention; o_proj with the residual add, the norm, gate/up,
silu * up and down with the second add in the other. Why: a one-token decode step on a 135M model
spends as long in small tensor ops as in reading the weights. It serves every step, prefill
chunks too, so that a token's arithmetic is the same whatever step computes it (a generated
token's K/V reused as a later prompt's prefix equals what that prompt would compute). Only layers
whose weights are all int8-kernel types, without biases, per-head norms or a non-SiLU activation,
in fp32, take it (fits).
"""

from __future__ import annotations

from typing import cast

import torch

from kvmemo.model.kernels import layer_ops
from kvmemo.model.kernels.layer_ops import DTYPE_CODES, MAX_COLS, add_rmsnorm, rope_, silu_mul
from kvmemo.model.kernels.quant_int8 import Fused, Int8Weights, mlp_block
from kvmemo.model.layers.basic import AttentionFn, GemmaRMSNorm, RMSNorm
from kvmemo.model.layers.linear import KernelChoice
from kvmemo.model.layers.native_linear import NativeLinear
from kvmemo.model.models.gemma3 import Gemma3DecoderLayer
from kvmemo.model.models.llama import LlamaForCausalLM
from kvmemo.model.models.llama_layer import DecoderLayer
from kvmemo.model.models.llava import LlavaForConditionalGeneration


def prepare(model: LlamaForCausalLM | LlavaForConditionalGeneration,
            choice: KernelChoice | None = None) -> KernelChoice:
    """Binds the model's projections to their kernels (`choice`, else the fastest here, probed
    once per machine), then the fast paths that fit. Returns the kernel choice."""
    language_model = (model.language_model if isinstance(model, LlavaForConditionalGeneration)
                      else model)
    choice = model.prepare_linears(choice)
    bind_fast_paths(language_model)
    return choice


def bind_fast_paths(model: LlamaForCausalLM) -> None:
    """After prepare_linears: DenseForward over the whole stack where it fits (dense weights),
    else a FusedLayerStep on each layer it fits (native weights)."""
    layers = cast("list[DecoderLayer]", list(model.layers))
    for layer in layers:
        step = GemmaFusedLayerStep if isinstance(layer, Gemma3DecoderLayer) else FusedLayerStep
        layer.fused_step = step(layer) if step.fits(layer) else None
    model.dense_forward = DenseForward(model) if DenseForward.fits(model) else None


class DenseForward:
    """embed -> [add + norm -> qkv -> RoPE -> attention -> o -> add + norm -> gate, up -> silu *
    up -> down] x layers -> add + final norm, for one LlamaForCausalLM with dense weights."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        # The model's parts, not the model: the model holds this object (model.dense_forward),
        # and a reference back would make a cycle that keeps a dropped engine's weights (about
        # 1 GB in fp32) until the cyclic collector runs.
        self.rotary = model.rotary
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
        layers = cast("list[DecoderLayer]", list(model.layers))
        norms: list[torch.nn.Module] = [model.norm] + [
            n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        return (
            layer_ops.kernel_available()
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
        cos, sin = self.rotary.cos_sin(positions, torch.float32)  # [T, 1, D/2] each
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


class FusedLayerStep:
    """norm -> q/k/v (+ RoPE) | attention | o_proj (+ residual) | norm -> gate/up | silu * up ->
    down (+ residual), for one DecoderLayer."""

    def __init__(self, layer: DecoderLayer) -> None:
        calls = [_single_call(lin) for lin in (layer.qkv, layer.o, layer.mlp.gate_up,
                                                 layer.mlp.down)]
        if any(call is None for call in calls):
            raise ValueError("FusedLayerStep needs every projection in one int8 call (fits())")
        self.qkv, self.o, self.gate_up, self.down = cast("list[Int8Weights]", calls)
        norms = cast("list[RMSNorm]", [layer.input_layernorm, layer.post_attention_layernorm])
        self.input_norm: torch.Tensor = norms[0].weight.detach()
        self.mlp_norm: torch.Tensor = norms[1].weight.detach()
        self.input_eps, self.mlp_eps = float(norms[0].eps), float(norms[1].eps)
        hidden = self.o.num_out  # the shapes the C block assumes, checked once here
        gate, up = (w.shape[0] for w in self.gate_up.weights)
        if not (gate == up == self.down.num_cols and self.gate_up.num_cols == hidden
                == self.down.num_out == self.qkv.num_cols == self.input_norm.numel()
                == self.mlp_norm.numel() and self.o.num_cols == layer.q_size):
            raise ValueError("FusedLayerStep: the layer's projection shapes do not chain")
        self.input_norm, self.mlp_norm = self.input_norm.contiguous(), self.mlp_norm.contiguous()
        # The block after attention: norms after o_proj and after the MLP (Gemma's), tanh-GELU
        # (Gemma's) or SiLU.
        self.post_norms: tuple[torch.Tensor, torch.Tensor] | None = None
        self.gelu = False
        self.num_heads, self.num_kv_heads = layer.num_heads, layer.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = layer.head_dim, layer.q_size, layer.kv_size

    @staticmethod
    def fits(layer: DecoderLayer) -> bool:
        return (
            type(layer) is DecoderLayer  # not a subclass with its own norms (Gemma)
            and all(type(norm) is RMSNorm and norm.weight.dtype == torch.float32
                    for norm in (layer.input_layernorm, layer.post_attention_layernorm))
            and layer.mlp.activation == "silu"
            and _projections_fit(layer)
        )

    def __call__(self, layer_idx: int, hidden: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        tokens = hidden.shape[0]
        half = self.head_dim // 2
        rope = (cos.reshape(tokens, half), sin.reshape(tokens, half),
                self.q_size + self.kv_size, self.head_dim)
        qkv = self.qkv(hidden, fused=self.qkv_options(rope))
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = attention(layer_idx, q, k, v)  # [T, H, D]
        return self.after_attention(out.reshape(tokens, self.q_size), hidden)

    def qkv_options(self, rope: tuple[torch.Tensor, torch.Tensor, int, int]) -> Fused:
        """What the q/k/v call folds in: the input norm before, RoPE after."""
        return Fused(norm=self.input_norm, eps=self.input_eps, rope=rope)

    def after_attention(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """o_proj, the residual adds and the MLP, in one call."""
        return mlp_block(attn, hidden, self.o, self.mlp_norm, self.mlp_eps, self.gate_up,
                         self.down, post_norms=self.post_norms, gelu=self.gelu)


class GemmaFusedLayerStep(FusedLayerStep):
    """norm -> q/k/v (+ per-head q/k norms, RoPE) | attention | o_proj (+ post norm, residual) |
    norm -> gate/up | gelu * up -> down (+ post norm, residual), for one Gemma3DecoderLayer:
    FusedLayerStep's two calls with Gemma's four norms, per-head norms and tanh-GELU folded in
    (quant_int8.Fused). Each (1 + w) norm weight is formed once here, in fp32, as HF forms it
    per call. Why: Gemma's extra norms and per-head norms are a dozen more small tensor ops per
    layer, which cost a one-token step on its 18 layers more than its layer products."""

    def __init__(self, layer: DecoderLayer) -> None:
        super().__init__(layer)
        gemma = cast(Gemma3DecoderLayer, layer)
        norms = [gemma.input_layernorm, gemma.q_norm, gemma.k_norm,
                 gemma.post_attention_layernorm, gemma.pre_feedforward_layernorm,
                 gemma.post_feedforward_layernorm]
        weights = [(1.0 + _weight(norm).float()).contiguous() for norm in norms]
        (self.input_norm, self.q_norm, self.k_norm, self.post_o_norm, self.mlp_norm,
         self.post_mlp_norm) = weights
        epsilons = {float(cast(GemmaRMSNorm, norm).eps) for norm in norms}
        if len(epsilons) != 1 or self.q_norm.numel() != self.head_dim:
            raise ValueError("GemmaFusedLayerStep: one eps for every norm and head-sized q/k norms")
        self.eps = self.input_eps = self.mlp_eps = epsilons.pop()
        self.post_norms, self.gelu = (self.post_o_norm, self.post_mlp_norm), True

    @staticmethod
    def fits(layer: DecoderLayer) -> bool:
        norms = [getattr(layer, name, None) for name in (
            "input_layernorm", "q_norm", "k_norm", "post_attention_layernorm",
            "pre_feedforward_layernorm", "post_feedforward_layernorm")]
        return (
            type(layer) is Gemma3DecoderLayer
            and all(type(norm) is GemmaRMSNorm and norm.weight.dtype == torch.float32
                    for norm in norms)
            and layer.mlp.activation == "gelu_pytorch_tanh"
            and _projections_fit(layer)
        )

    def qkv_options(self, rope: tuple[torch.Tensor, torch.Tensor, int, int]) -> Fused:
        return Fused(norm=self.input_norm, eps=self.eps, rope=rope,
                     head_norms=(self.q_norm, self.k_norm, self.q_size, self.kv_size))


def _projections_fit(layer: DecoderLayer) -> bool:
    """Each projection is one int8-kernel call without a bias; gate/up exactly two weights."""
    mlp = layer.mlp
    linears = (getattr(layer, "qkv", None), getattr(layer, "o", None),
               getattr(mlp, "gate_up", None), getattr(mlp, "down", None))
    return (
        all(_single_call(lin) is not None and lin.bias is None  # type: ignore[union-attr]
            for lin in linears)
        and len(_single_call(mlp.gate_up).weights) == 2  # type: ignore[union-attr]
    )


def _single_call(linear: object) -> Int8Weights | None:
    """The one int8-kernel call a NativeLinear's product makes, if that is all it does."""
    if not isinstance(linear, NativeLinear):
        return None
    return linear.single_int8_call()



def _weight(norm: torch.nn.Module) -> torch.Tensor:
    return cast(RMSNorm, norm).weight.detach().contiguous()
