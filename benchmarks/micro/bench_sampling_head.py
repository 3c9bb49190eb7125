"""The bf16 mode's sampling head against the fp32 head: how far apart the distributions are.

    python -m benchmarks.micro.bench_sampling_head [--max-tokens 64]

In the bf16 mode, rows sampled at a temperature (no logprobs) draw from the head's bf16 product
with fp32 sums (LlamaForCausalLM.sampling_logits), not from the fp32 head that greedy tokens and
logprobs read. Positions: the fp8 benchmark's 16 prompts, each followed by the fp32 mode's
greedy continuation of --max-tokens (teacher forced, one chunk per prompt through the paged
cache). At every position the bf16 engine's hidden state goes through both heads; softmax at
temperature 1. Reports the total-variation distance (the share of draws that differ under the
best coupling) and KL(fp32 head || bf16 head), and, for scale, the same distances from the fp32
mode's distribution to each head of the bf16 mode. Writes benchmarks/results/sampling_head.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.machine_info import cpu_label
from benchmarks.micro.bench_fp8 import paged_logits, prompts
from benchmarks.paths import RESULTS
from kvmemo import LLM, SamplingParams

OUT = RESULTS / "sampling_head.json"


def distances(p: torch.Tensor, q: torch.Tensor) -> dict[str, float]:
    """Total variation and KL(p || q) per row of two [N, V] distributions: mean and max."""
    tv = 0.5 * (p - q).abs().sum(-1)
    kl = (p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum(-1)
    return {"tv_mean": round(float(tv.mean()), 5), "tv_max": round(float(tv.max()), 5),
            "kl_mean": float(f"{float(kl.mean()):.3e}")}


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    fp32 = LLM(dtype="float32", num_blocks=256, enable_prefix_caching=False)
    ids = prompts(fp32)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    texts = [p + o.outputs[0].token_ids[:-1]
             for p, o in zip(ids, fp32.generate(ids, params, use_tqdm=False))]
    exact = torch.cat([paged_logits(fp32, t, chunk=len(t)) for t in texts]).softmax(-1)
    del fp32
    bf16 = LLM(dtype="bfloat16", num_blocks=256, enable_prefix_caching=False)
    model = bf16.engine.runner.model
    hidden: list[torch.Tensor] = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda h: hidden.append(h.detach().clone()) or compute_logits(h)
    for t in texts:
        paged_logits(bf16, t, chunk=len(t))
    model.compute_logits = compute_logits
    states = torch.cat(hidden)
    fp32_head = model.compute_logits(states).float().softmax(-1)
    bf16_head = model.sampling_logits(states).float().softmax(-1)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_label(),  # the bf16 products' kernels differ by CPU
        "torch": torch.__version__,
        "positions": states.shape[0],
        "bf16_head_vs_fp32_head": distances(fp32_head, bf16_head),
        "fp32_mode_vs_bf16_mode_fp32_head": distances(exact, fp32_head),
        "fp32_mode_vs_bf16_mode_bf16_head": distances(exact, bf16_head),
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
