"""FP8 KV scales: one K and one V scale per (layer, kv head), calibrated once at engine start.

Invariant: deterministic. A fixed calibration text runs through the model with full-precision
attention; scale = 2^ceil(log2(amax * FP8_MARGIN / FP8_MAX)), a power of two (so x / scale is
exact and tiny numeric differences between machines rarely change it). Equal scales give equal
digests, and the digest joins the block-hash namespace, so blocks quantised with different
scales never mix.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kvmemo.attention.cache import FP8_MAX

# Headroom over the calibration maximum before a value clips: e4m3 has the same 3-bit relative
# precision everywhere above 2^-6 * scale, so headroom costs nothing but the far-below-max tail.
FP8_MARGIN = 1.5
SCALES_VERSION = 1  # bump when the text, margin or rounding changes: the digest changes with it

# Varied registers (prose, dialogue, code, numbers, lists) so every head sees typical magnitudes.
CALIBRATION_TEXT = """\
The history of the printing press begins in the fifteenth century, when Johannes Gutenberg \
combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, more \
than twenty million volumes had been printed across Europe, and the price of a book fell sharply.
User: Can you explain how a hash table works?
Assistant: Sure. A hash table stores key-value pairs in an array. A hash function maps each key \
to an index; collisions are resolved by chaining or open addressing. Lookups take O(1) time on \
average.
def fibonacci(n: int) -> list[int]:
    sequence = [0, 1]
    while len(sequence) < n:
        sequence.append(sequence[-1] + sequence[-2])
    return sequence[:n]
Shopping list: 3 apples, 2 litres of milk, 500 g of flour, 12 eggs, 1 jar of honey.
Temperatures this week (C): 14.2, 15.8, 13.1, 17.4, 19.0, 18.6, 16.3.
The mitochondria is the powerhouse of the cell; it produces ATP through oxidative \
phosphorylation. Photosynthesis, in contrast, takes place in the chloroplasts of plant cells.
SELECT name, COUNT(*) FROM orders WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC;
In 1969, Apollo 11 landed on the Moon. Neil Armstrong said: "That's one small step for man, one \
giant leap for mankind." The mission lasted eight days, three hours and eighteen minutes.
Q: What is the capital of Australia? A: Canberra. Q: What is 17 times 23? A: 391.
"""

# attention(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class KVScales:
    """K and V scales [num_layers, num_kv_heads] fp32: stored fp8 value * scale = real value."""

    k: torch.Tensor
    v: torch.Tensor

    def digest(self) -> str:
        """Hex sha256 of the version and the exact scale bytes: part of the block-hash namespace."""
        h = hashlib.sha256(f"kvmemo-fp8-scales-v{SCALES_VERSION}".encode())
        for t in (self.k, self.v):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()[:32]


def scales_from_amax(amax: torch.Tensor, margin: float = FP8_MARGIN) -> torch.Tensor:
    """Power-of-two scales with headroom: amax [..] -> 2^ceil(log2(amax * margin / FP8_MAX))."""
    target = amax.float().clamp_min(1e-12) * margin / FP8_MAX
    return torch.exp2(torch.ceil(torch.log2(target)))


@torch.inference_mode()
def calibrate_kv_scales(
    model: torch.nn.Module, token_ids: list[int], num_layers: int, num_kv_heads: int
) -> KVScales:
    """Run `token_ids` through `model(input_ids, positions, attention)` at full precision and
    derive K/V scales from each (layer, kv head)'s absolute maximum (K after RoPE, as cached)."""
    if not token_ids:
        raise ValueError("fp8 calibration needs a non-empty token_ids list")
    k_amax = torch.zeros(num_layers, num_kv_heads)
    v_amax = torch.zeros(num_layers, num_kv_heads)

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_amax[layer] = torch.maximum(k_amax[layer], k.abs().amax(dim=(0, 2)).float().cpu())
        v_amax[layer] = torch.maximum(v_amax[layer], v.abs().amax(dim=(0, 2)).float().cpu())
        group = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [Hq, T, D]
            k.transpose(0, 1).repeat_interleave(group, 0),
            v.transpose(0, 1).repeat_interleave(group, 0),
            is_causal=True,
            scale=1 / math.sqrt(q.shape[-1]),
        )
        return out.transpose(0, 1)

    device = next(model.parameters()).device
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    model(ids, torch.arange(len(token_ids), device=device), attention)
    return KVScales(k=scales_from_amax(k_amax), v=scales_from_amax(v_amax))
