"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated SiLU MLP, and the
callable types a decoder is handed (attention) or bound to (fast paths).

Tensors are flattened token batches [T, ...]; RoPE is rotate-half (GPT-NeoX / HF Llama) style and
indexed by an explicit per-token positions tensor, never by 0..T-1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvmemo.model.layers.linear import KernelChoice, Linear

# attention(layer_idx, q [T, H, D], k [T, KV, D], v [T, KV, D]) -> [T, H, D]; RoPE already applied.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class FastLayerStep(Protocol):
    """A decoder layer's forward by other kernels (models/llama_fast.py), for every step."""

    def __call__(self, layer_idx: int, hidden: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, attention: AttentionFn) -> torch.Tensor: ...


class FastForward(Protocol):
    """A whole decoder stack's forward by other kernels: fp32 embeddings [T, C] (not modified) ->
    the final-normed hidden states [T, C] fp32 (models/llama_fast.py)."""

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 attention: AttentionFn) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 like HF's LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, bit-identical to transformers' rope init."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling or {})
    if rope_type == "freq_factors":  # llama.cpp's rope_freqs tensor: theta_i / factor_i
        factors = torch.tensor(
            (rope_scaling or {})["freq_factors"], dtype=torch.float32, device="cpu"
        )  # [D/2]
        return inv_freq / factors
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Same arithmetic as transformers' _compute_llama3_parameters.
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


INITIAL_ROPE_POSITIONS = 1024  # cos/sin rows built at start on the CPU (more as positions need)
ACCELERATOR_ROPE_POSITIONS = 8192  # at least this many before the tables move to a GPU


class RotaryEmbedding:
    """Owns an fp32 cos/sin cache [num_positions, head_dim // 2]; grows it on demand.

    Deliberately not an nn.Module: the cache stays fp32 when the model is cast to bf16, is built on
    CPU even under a meta-device context, and follows the positions tensor's device lazily.
    """

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
        max_position_embeddings: int,
    ) -> None:
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.inv_freq = rope_inv_freq(head_dim, rope_theta, rope_scaling)  # [D/2] fp32, CPU
        # Why small: a table is touched memory (Gemma 3's four of 8,192 positions held 16 MiB
        # of a start's 600); on the CPU they double as positions arrive, rebuilt whole with the
        # same elementwise arithmetic, so a position's values do not depend on the table's size.
        self.cos_cache, self.sin_cache = self._build_cache(
            min(max_position_embeddings, INITIAL_ROPE_POSITIONS))

    def _build_cache(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(num_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, self.inv_freq)  # [P, D/2]
        return freqs.cos(), freqs.sin()

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, D/2] ready to broadcast over heads."""
        # On a GPU the largest position is read back (a host sync, which a CUDA graph capture
        # cannot have) only while the tables are shorter than the model's limit, past which
        # the engine never goes; on the CPU it costs nothing and tables grow for any position.
        if (positions.numel()
                and (positions.device.type == "cpu"
                     or self.cos_cache.shape[0] < self.max_position_embeddings)
                and int(positions.max()) >= self.cos_cache.shape[0]):
            needed = max(2 * self.cos_cache.shape[0], int(positions.max()) + 1)
            self.cos_cache, self.sin_cache = self._build_cache(needed)
        if self.cos_cache.device != positions.device:
            longest = min(self.max_position_embeddings, ACCELERATOR_ROPE_POSITIONS)
            if positions.device.type != "cpu" and self.cos_cache.shape[0] < longest:
                # On an accelerator the tables start as long as they always did, so the host
                # syncs above stop at the same length.
                self.cos_cache, self.sin_cache = self._build_cache(longest)
            self.cos_cache = self.cos_cache.to(positions.device)
            self.sin_cache = self.sin_cache.to(positions.device)
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)  # [T, 1, D/2]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [T, H, D], cos/sin [T, 1, D/2] -> [T, H, D]."""
    x1, x2 = x.chunk(2, dim=-1)  # each [T, H, D/2]
    # Equals x * cat(cos, cos) + rotate_half(x) * cat(sin, sin) with half the multiplies.
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class GemmaRMSNorm(nn.Module):
    """Gemma's norm: (x / rms(x)) * (1 + weight), all in fp32, then cast back (HF's arithmetic,
    op for op, so fp32 outputs are bit-equal)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up live in one [2*I, hidden] weight (one load).
    act is SiLU (Llama) or tanh-approximated GELU (Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def prepare_linears(self, choice: KernelChoice) -> None:
        # Two products over the weight's row halves (views, no copy) rather than one over all of
        # it: MKL runs the [T, 576] x [576, 3072] shape ~25% below its [.., 1536] rate on CPU
        # (measured: MLP 74.6 -> 63.3 ms at T=1,024, 3.1 -> 2.8 ms at T=32, one thread), and the
        # in-place silu/mul spares two [T, I] temporaries.
        weight = self.gate_up_proj.weight
        self.gate = Linear(weight[: self.intermediate_size], None, choice)
        self.up = Linear(weight[self.intermediate_size :], None, choice)
        self.down = Linear(self.down_proj.weight, None, choice)

    def linear_weights(self) -> list[torch.Tensor]:
        weight, size = self.gate_up_proj.weight, self.intermediate_size
        return [weight[:size], weight[size:], self.down_proj.weight]

    # One product for both halves when set (native GGUF weights: x is quantized once for both).
    gate_up: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            both = self.gate_up(x)  # [T, 2I]
            gate, up = both[..., : self.intermediate_size], both[..., self.intermediate_size :]
        else:
            gate = self.gate(x)  # [T, I]
            up = self.up(x)
        if gate.dtype != torch.float32:
            # act(gate) * up in fp32, rounded once (bf16 rounding both the activation and the
            # product cost 0.2 points of teacher-forced agreement with fp32).
            return self.down(self._activate(gate.float()).mul_(up).to(gate.dtype))
        return self.down(self._activate(gate).mul_(up))  # [T, hidden]

    def _activate(self, gate: torch.Tensor) -> torch.Tensor:
        """act(gate), in place where the activation allows."""
        if self.activation == "silu":
            return F.silu(gate, inplace=True)
        return F.gelu(gate, approximate="tanh")
