"""FP8 KV error diagnostics: which side (K or V) and which transform the e4m3 error comes from.

    python -m benchmarks.micro.fp8_variants [--prompts 16] [--free] [VARIANT ...]

Each VARIANT is `K/V` (e.g. `weighted/fp32`: only K goes through fp8), a suffix `@sink` keeps
token 0 exact. Per side: fp32, bf16; e4m3 with per-(layer, kv head) power-of-two scales after
`scales` (nothing else, the previous design), `mean` (plain mean offset), `weighted` (the
attention-weighted offsets of fp8.calibrate_kv_scales: what the engine does), `rotated` (those
offsets and the Hadamard rotation, calibrate_kv_scales(rotate=True)), `qpca` / `kpca` (weighted
offsets, then the eigenbasis of the calibration queries' / keys' second moment per head instead
of Hadamard), `gptq` (rotated, then error-feedback rounding of each vector against the queries'
second moment, K only); for reference, codes that are not e4m3: `int8` (uniform per channel),
`m4` (rotated transform, 4 mantissa bits, no range limit). `--margin` sets the scales' headroom (1.5).

Dense fake quantisation (quantise, decode, attend in fp32 over a per-layer KV list), not the
engine's pages, so the figures say where the error is rather than what bench_fp8.py measures.
Reports, against full-precision K/V on the same path: teacher-forced argmax agreement and mean
KL(fp32 || variant) of the next-token distribution over the float32 greedy continuation, and
with --free, free-running greedy agreement. Prints one line per variant; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.micro.bench_fp8 import prompts
from kvmemo import LLM
from kvmemo.attention.cache import FP8_DTYPE, FP8_MAX
from kvmemo.attention.fp8 import calibrate_kv_scales, calibration_segments, scales_from_amax

Quantiser = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, x [T, Hkv, D]) -> decoded x


class Calibration:
    """Every K/V and the queries' second moment of the calibration segments, per layer."""

    def __init__(self, llm: LLM) -> None:
        model, arch = llm.engine.runner.model, llm.engine.loaded.arch_config
        self.num_kv_heads, self.head_dim = arch.num_key_value_heads, arch.head_dim
        group = arch.num_attention_heads // self.num_kv_heads
        layers = arch.num_hidden_layers
        seen: dict[str, list[list[torch.Tensor]]] = {"k": [[] for _ in range(layers)], "v": [[] for _ in range(layers)]}
        self.qq = torch.zeros(layers, self.num_kv_heads, self.head_dim, self.head_dim, dtype=torch.float64)

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            seen["k"][layer].append(k.float())
            seen["v"][layer].append(v.float())
            qg = q.float().view(q.shape[0], self.num_kv_heads, group, self.head_dim)
            self.qq[layer] += torch.einsum("thgd,thge->hde", qg, qg).double()
            return causal(q, k, v)

        segments = calibration_segments(llm.engine.processor.encode_prompt)
        with torch.inference_mode():
            for ids in segments:
                model(torch.tensor(ids), torch.arange(len(ids)), attention)
            self.rotated = calibrate_kv_scales(model, segments, layers, self.num_kv_heads, rotate=True)
        self.data = {side: torch.stack([torch.cat(x) for x in xs]) for side, xs in seen.items()}  # [L, N, Hkv, D]


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] over k, v [S, Hkv, D]; causal when mask is None."""
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=mask, is_causal=mask is None, scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return out.transpose(0, 1)


def e4m3(y: torch.Tensor) -> torch.Tensor:
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()


def transform_quantiser(cal: Calibration, side: str, offset: torch.Tensor, basis: torch.Tensor,
                        margin: float, rounding: str = "e4m3") -> Quantiser:
    """offset [L, Hkv, D], basis [L, Hkv, D, D] orthogonal; scales from the calibration amax."""
    y = torch.einsum("lthd,lhde->lthe", cal.data[side] - offset[:, None], basis)
    scale = scales_from_amax(y.abs().amax(dim=(1, 3)), margin)[..., None]  # [L, Hkv, 1]
    feedback = error_feedback(cal, basis) if rounding == "gptq" else None

    def quantise(layer: int, x: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("thd,hde->the", x.float() - offset[layer], basis[layer]) / scale[layer]
        if rounding == "m4":
            mantissa, exponent = torch.frexp(y)
            q = torch.ldexp((mantissa * 32).round() / 32, exponent)
        elif feedback is not None:
            q = torch.empty_like(y)
            for i in range(y.shape[-1]):  # round channel i, push its error onto the later ones
                q[..., i] = e4m3(y[..., i])
                y[..., i + 1:] -= (y[..., i] - q[..., i])[..., None] * feedback[layer][None, :, i, i + 1:]
        else:
            q = e4m3(y)
        return torch.einsum("the,hde->thd", q * scale[layer], basis[layer]) + offset[layer]

    return quantise


def error_feedback(cal: Calibration, basis: torch.Tensor) -> torch.Tensor:
    """GPTQ's row-normalised upper Cholesky factor of H^-1, H = basis^T E[q q^T] basis + 0.1 damping."""
    h = torch.einsum("lhdc,lhde,lhef->lhcf", basis.double(), cal.qq, basis.double())
    h = h + 0.1 * h.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(h.shape[-1], dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    return (u / u.diagonal(dim1=-2, dim2=-1)[..., None]).float()


def quantiser(cal: Calibration, side: str, name: str, margin: float) -> Quantiser:
    layers, heads, d = cal.data[side].shape[0], cal.num_kv_heads, cal.head_dim
    zeros, eye = torch.zeros(layers, heads, d), torch.eye(d).expand(layers, heads, d, d)
    weighted = cal.rotated.k_offset if side == "k" else cal.rotated.v_offset  # offsets do not depend on R
    hadamard = cal.rotated.rotation.expand(layers, heads, d, d)
    if name == "fp32":
        return lambda layer, x: x.float()
    if name == "bf16":
        return lambda layer, x: x.to(torch.bfloat16).float()
    if name == "int8":
        lo, hi = cal.data[side].amin(1), cal.data[side].amax(1)  # [L, Hkv, D]
        mid, step = (lo + hi) / 2, (hi - lo).clamp_min(1e-12) / 255
        return lambda layer, x: ((x.float() - mid[layer]) / step[layer]).round().clamp(-128, 127) * step[layer] + mid[layer]
    if name in ("qpca", "kpca"):
        centred = cal.data[side] - weighted[:, None]
        moment = cal.qq.float() if name == "qpca" else torch.einsum("lthd,lthe->lhde", centred, centred)
        return transform_quantiser(cal, side, weighted, torch.linalg.eigh(moment.double()).eigenvectors.float(), margin)
    if name == "gptq" and side != "k":
        raise ValueError("gptq weighs errors by the queries: K only")
    offsets = {"scales": zeros, "mean": cal.data[side].mean(1), "weighted": weighted}
    if name in offsets:
        return transform_quantiser(cal, side, offsets[name], eye, margin)
    if name in ("rotated", "gptq", "m4"):
        return transform_quantiser(cal, side, weighted, hadamard, margin, rounding=name)
    raise ValueError(f"unknown variant side {name!r}")


class CachedAttention:
    """Dense attention over a growing per-layer list of decoded K/V (the variant's 'cache')."""

    def __init__(self, qk: Quantiser, qv: Quantiser, exact_first: bool) -> None:
        self.qk, self.qv, self.exact_first = qk, qv, exact_first
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kq, vq = self.qk(layer, k), self.qv(layer, v)
        if self.exact_first and layer not in self.k:
            kq[0], vq[0] = k[0].float(), v[0].float()
        self.k[layer] = torch.cat([self.k[layer], kq]) if layer in self.k else kq
        self.v[layer] = torch.cat([self.v[layer], vq]) if layer in self.v else vq
        total, new = self.k[layer].shape[0], q.shape[0]
        mask = torch.arange(total)[None, :] <= torch.arange(total - new, total)[:, None]
        return causal(q, self.k[layer], self.v[layer], mask).to(q.dtype)


@torch.inference_mode()
def run(model, ids: list[int], attention: CachedAttention, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """Logits of the prompt [len(ids), vocab] and `new_tokens` greedy tokens after it."""
    logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attention))
    prompt_logits, out = logits, []
    for position in range(len(ids), len(ids) + new_tokens):
        out.append(int(logits[-1].argmax()))
        logits = model.compute_logits(model(torch.tensor(out[-1:]), torch.tensor([position]), attention))
    return prompt_logits, out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="*", default=["scales/scales", "weighted/weighted"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--margin", type=float, default=1.5)
    parser.add_argument("--free", action="store_true", help="also free-running agreement (slow)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(kv_cache_dtype="float32", num_blocks=8, enable_prefix_caching=False)
    model, cal = llm.engine.runner.model, Calibration(llm)
    exact = quantiser(cal, "k", "fp32", args.margin)
    prompt_ids = prompts(llm)[: args.prompts]
    reference = [run(model, ids, CachedAttention(exact, exact, False), args.max_tokens)[1] for ids in prompt_ids]
    forced = [run(model, ids + ref[:-1], CachedAttention(exact, exact, False), 0)[0][len(ids) - 1:]
              for ids, ref in zip(prompt_ids, reference)]
    for variant in args.variants:
        start = time.perf_counter()
        name, _, sink = variant.partition("@")
        k_name, v_name = name.split("/")
        qk, qv = quantiser(cal, "k", k_name, args.margin), quantiser(cal, "v", v_name, args.margin)
        same = total = 0
        kl = 0.0
        for ids, ref, ref_logits in zip(prompt_ids, reference, forced):
            logits = run(model, ids + ref[:-1], CachedAttention(qk, qv, bool(sink)), 0)[0][len(ids) - 1:]
            same += int((logits.argmax(-1) == torch.tensor(ref)).sum())
            total += len(ref)
            kl += float(F.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True, reduction="sum"))
        row = {"teacher_forced": round(same / total, 4), "kl": round(kl / total, 5)}
        if args.free:
            outs = [run(model, ids, CachedAttention(qk, qv, bool(sink)), args.max_tokens)[1] for ids in prompt_ids]
            row["free_running"] = round(sum(a == b for r, o in zip(reference, outs) for a, b in zip(r, o)) / total, 4)
        print(f"{variant:24s} {row} {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
