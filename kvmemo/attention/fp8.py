"""FP8 KV transform: per (layer, kv head) an offset, a rotation and a scale, calibrated at start.

Invariant: stored = fp8(((x - offset) @ rotation) / scale) and x ~= stored * scale @ rotation.T +
offset. All three are exact for attention (see fp8_fold.fold_fp8_query), so they only move the
e4m3 rounding error. The engine calibrates offsets and scales; the rotation is the identity
unless asked for (calibrate_kv_scales(rotate=True)). Deterministic: a fixed calibration text
through the model at full precision; scale = 2^ceil(log2(amax * FP8_MARGIN / FP8_MAX)) of the
offset (and rotated) values. Equal transforms
give equal digests, and the digest joins the block-hash namespace, so blocks quantised with
different transforms never mix.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from kvmemo.attention.cache import FP8_MAX

# Headroom over the calibration maximum before a value clips: e4m3 has the same 3-bit relative
# precision everywhere above 2^-6 * scale, so headroom costs nothing but the far-below-max tail.
FP8_MARGIN = 1.5
SCALES_VERSION = 2  # bump when the text, segments, margin or rounding changes: the digest changes

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

@dataclass(frozen=True)
class KVScales:
    """The fp8 transform of every (layer, kv head): stored fp8 value * scale @ rotation.T + offset
    = real value. Scales [num_layers, num_kv_heads], offsets [num_layers, num_kv_heads, head_dim]
    (fp32), rotation [head_dim, head_dim] orthogonal, shared by all heads."""

    k: torch.Tensor
    v: torch.Tensor
    k_offset: torch.Tensor
    v_offset: torch.Tensor
    rotation: torch.Tensor

    @classmethod
    def plain(cls, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> KVScales:
        """Scales only: zero offsets, identity rotation (the pre-smoothing transform)."""
        zeros = torch.zeros(*k.shape, head_dim)
        return cls(k, v, zeros, zeros.clone(), torch.eye(head_dim))

    def digest(self) -> str:
        """Hex sha256 of the version and the exact bytes of every field: part of the namespace."""
        h = hashlib.sha256(f"kvmemo-fp8-scales-v{SCALES_VERSION}".encode())
        for t in (self.k, self.v, self.k_offset, self.v_offset, self.rotation):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()[:32]


def scales_from_amax(amax: torch.Tensor, margin: float = FP8_MARGIN) -> torch.Tensor:
    """Power-of-two scales with headroom: amax [..] -> 2^ceil(log2(amax * margin / FP8_MAX))."""
    target = amax.float().clamp_min(1e-12) * margin / FP8_MAX
    return torch.exp2(torch.ceil(torch.log2(target)))


def hadamard_rotation(head_dim: int) -> torch.Tensor:
    """[D, D] orthogonal: a Sylvester Hadamard / sqrt(D) with fixed pseudo-random row signs.

    Why: e4m3's error is relative to each element, so a q.k error is largest when q and k both
    concentrate in the same few channels (RoPE's slow pairs, attention-sink keys); rotating both
    spreads that energy over all D channels. Identity when D is not a power of two.
    """
    if head_dim & (head_dim - 1):
        return torch.eye(head_dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    bits = hashlib.sha256(b"kvmemo-fp8-rotation").digest() * (1 + head_dim // 256)
    signs = torch.tensor([1.0 if (bits[i // 8] >> (i % 8)) & 1 else -1.0 for i in range(head_dim)],
                         dtype=torch.float64)
    return (h * signs[:, None] / math.sqrt(head_dim)).float()


def calibration_segments(encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Token ids to calibrate on: the whole CALIBRATION_TEXT, then each of its lines on its own.

    Each line starts a sequence, so the offsets see attention sinks of many first tokens, not one.
    """
    lines = [line for line in CALIBRATION_TEXT.splitlines() if line.strip()]
    return [encode(CALIBRATION_TEXT)] + [encode(line) for line in lines]


@torch.inference_mode()
def calibrate_kv_scales(
    model: torch.nn.Module,
    segments: list[list[int]],
    num_layers: int,
    num_kv_heads: int,
    smooth: bool = True,
    rotate: bool = False,
) -> KVScales:
    """Run each segment through `model(input_ids, positions, attention)` at full precision and
    derive the fp8 transform of each (layer, kv head) (K after RoPE, as cached).

    Offsets are attention-weighted means, chosen to minimise the error that matters: a score
    error on key j costs in proportion to the attention p_ij it gets, and e4m3 rounds
    q_c * (k_jc - mu_c) with error ~ |q_c (k_jc - mu_c)|, so mu_c = sum p_ij q_ic^2 k_jc /
    sum p_ij q_ic^2; for V the output error is sum_j p_ij e_j, so mu = sum p_ij^2 v_j / sum p_ij^2.
    smooth=False keeps zero offsets (scales only, for comparisons). rotate=True adds the Hadamard
    rotation: it lowers the mean KL to float32 by ~30% on SmolLM2 yet made greedy runs diverge
    earlier (10 of 16 prompts, benchmarks/notes.md), so it is measured, not the default.
    A plain mean is worse than no offset on this model: attention sinks (most of the attention)
    lack the bias of the other keys, and subtracting it grows exactly their error.
    """
    if not segments or not all(segments):
        raise ValueError("fp8 calibration needs a non-empty list of non-empty token id segments")
    stats = _OffsetStats(num_layers, num_kv_heads)
    device = next(model.parameters()).device
    for ids in segments:
        model(torch.tensor(ids, dtype=torch.int64, device=device),
              torch.arange(len(ids), device=device), stats.attention)
    k_offset, v_offset = stats.offsets()
    head_dim = k_offset.shape[-1]
    rotation = hadamard_rotation(head_dim) if rotate else torch.eye(head_dim)
    if not smooth:
        k_offset, v_offset = torch.zeros_like(k_offset), torch.zeros_like(v_offset)
    k_amax = torch.stack([((k - k_offset[layer]) @ rotation).abs().amax(dim=(0, 2))
                          for layer, k in enumerate(stats.keys())])  # [num_layers, num_kv_heads]
    v_amax = torch.stack([((v - v_offset[layer]) @ rotation).abs().amax(dim=(0, 2))
                          for layer, v in enumerate(stats.values())])
    return KVScales(
        scales_from_amax(k_amax), scales_from_amax(v_amax), k_offset, v_offset, rotation
    )


class _OffsetStats:
    """Accumulates, per layer, the weighted sums behind the offsets and every K and V seen."""

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.num_kv_heads = num_kv_heads
        self.k_num: list[torch.Tensor | float] = [0.0] * num_layers  # [Hkv, D] sum p q^2 k
        self.k_den: list[torch.Tensor | float] = [0.0] * num_layers  # [Hkv, D] sum p q^2
        self.v_num: list[torch.Tensor | float] = [0.0] * num_layers  # [Hkv, D] sum p^2 v
        self.v_den: list[torch.Tensor | float] = [0.0] * num_layers  # [Hkv, 1] sum p^2
        self.k_seen: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # [T, Hkv, D] each
        self.v_seen: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention in fp32 (explicit, to see the probabilities).

        q [T, Hq, D] -> [T, Hq, D].
        """
        num_tokens, num_heads, head_dim = q.shape
        group, dtype = num_heads // self.num_kv_heads, q.dtype
        q, k, v = q.float(), k.float(), v.float()
        qg = q.view(num_tokens, self.num_kv_heads, group, head_dim)  # [T, Hkv, G, D]
        scores = torch.einsum("thgd,shd->hgts", qg, k) / math.sqrt(head_dim)  # [Hkv, G, T, S]
        causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        weight = torch.einsum("hgts,thgd->shd", probs, qg * qg)  # [S, Hkv, D] sum_i p_ij q_ic^2
        self.k_num[layer] = self.k_num[layer] + (weight * k).sum(0).cpu()
        self.k_den[layer] = self.k_den[layer] + weight.sum(0).cpu()
        weight_v = (probs * probs).sum(dim=(1, 2)).transpose(0, 1)  # [S, Hkv] sum_i p_ij^2
        self.v_num[layer] = self.v_num[layer] + (weight_v[..., None] * v).sum(0).cpu()
        self.v_den[layer] = self.v_den[layer] + weight_v.sum(0)[:, None].cpu()
        self.k_seen[layer].append(k.cpu())
        self.v_seen[layer].append(v.cpu())
        out = torch.einsum("hgts,shd->thgd", probs, v)
        return out.reshape(num_tokens, num_heads, head_dim).to(dtype)

    def offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V offsets [num_layers, Hkv, D]; a channel no query weighs (den 0) gets 0."""
        def ratio(num: list, den: list) -> torch.Tensor:
            return torch.stack(
                [torch.where(d > 0, n / d.clamp_min(1e-30), 0.0) for n, d in zip(num, den)]
            )
        return ratio(self.k_num, self.k_den), ratio(self.v_num, self.v_den)

    def keys(self) -> list[torch.Tensor]:
        return [torch.cat(seen) for seen in self.k_seen]

    def values(self) -> list[torch.Tensor]:
        return [torch.cat(seen) for seen in self.v_seen]
