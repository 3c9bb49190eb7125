"""FP8 KV cache quality: greedy token agreement and perplexity against a full-precision KV.

    python -m benchmarks.micro.bench_fp8 [--max-tokens 64] [--chunk 128] [--threads 1] [--only LABEL --out PATH]

Agreement: 16 prompts x 64 greedy tokens (ignore_eos), each KV dtype against float32 KV: the
share of equal tokens position by position when generating freely, the share before each
prompt's first divergence, and teacher-forced (the float32 continuation as context, argmax
compared at every position, through the paged cache). Perplexity: benchmarks/data/perplexity_text.txt fed in chunks of --chunk tokens
through the engine's model, paged cache and attention backend, so every chunk (and every token
within it) reads K/V that went through the KV dtype. "fp8_e4m3" is the engine's calibrated fp8
transform (offsets and scales; attention/fp8.py), "+ rotation" adds the Hadamard rotation
(calibrate_kv_scales(rotate=True)); "fp8_e4m3 scales only" keeps its
per-head scales without offsets or rotation (the design before them), and "fp8_e4m3 unscaled"
has all scales 1 (the pre-issue-4 plain cast). Writes benchmarks/results/fp8_kv.json;
--only LABEL (repeatable) runs float32 and those configs and writes --out instead.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.paths import DATA
from benchmarks.paths import RESULTS as RESULTS_DIR
from kvmemo import LLM, SamplingParams
from kvmemo.attention.fp8 import calibrate_kv_scales, calibration_segments
from kvmemo.attention.metadata import AttentionMetadata
from tests.engine.prompts import CHAT_PROMPTS, RAW_PROMPTS

TEXT = DATA / "perplexity_text.txt"
RESULTS = RESULTS_DIR / "fp8_kv.json"
MORE_PROMPTS = [
    "The most important invention of the twentieth century was",
    "Here is a short recipe for pancakes:",
    "import numpy as np\n\ndef normalize(x):\n",
    "The difference between a virus and a bacterium is",
    "Dear hiring manager, I am writing to apply for",
    "The planets of the solar system, in order from the sun, are",
    "A good way to learn a new language is",
]
CONFIGS = [  # (label, kv_cache_dtype, fp8 transform: calibrated, rotated, scales only, unscaled)
    ("float32", "float32", ""),
    ("bfloat16", "bfloat16", ""),
    ("fp8_e4m3", "fp8_e4m3", "calibrated"),
    ("fp8_e4m3 + rotation", "fp8_e4m3", "rotated"),
    ("fp8_e4m3 scales only", "fp8_e4m3", "scales only"),
    ("fp8_e4m3 unscaled", "fp8_e4m3", "unscaled"),
    # Not a KV dtype: bf16 compute (weights, activations and KV in bf16) against fp32 compute.
    ("bf16 compute", "auto", "compute:bfloat16"),
]


def prompts(llm: LLM) -> list[list[int]]:
    processor = llm.engine.processor
    ids = [processor.encode_prompt(p) for p in RAW_PROMPTS + MORE_PROMPTS]
    ids += [processor.encode_chat(c)[1] for c in CHAT_PROMPTS]
    assert len(ids) == 16, len(ids)
    return ids


@torch.inference_mode()
def paged_logits(llm: LLM, token_ids: list[int], chunk: int) -> torch.Tensor:
    """fp32 logits [N, vocab] of every position, fed chunk by chunk through the paged KV cache."""
    runner = llm.engine.runner
    cache, backend, device = runner.kv_cache, runner.attention_backend, runner.device
    num_blocks = -(-len(token_ids) // cache.block_size)
    if num_blocks > cache.num_blocks:
        raise ValueError(f"text needs {num_blocks} blocks, the pool has {cache.num_blocks}")
    table = list(range(num_blocks))  # prefix caching is off: nothing else owns these pages
    out = []
    for start in range(0, len(token_ids), chunk):
        ids = token_ids[start : start + chunk]
        metadata = AttentionMetadata.build(
            block_tables=[table], num_computed_tokens=[start], query_lens=[len(ids)],
            block_size=cache.block_size, num_cache_blocks=cache.num_blocks,
            device=device)
        hidden = runner.model(
            torch.tensor(ids, device=device), torch.arange(start, start + len(ids), device=device),
            lambda layer, q, k, v: backend.forward(layer, q, k, v, cache, metadata))
        out.append(runner.model.compute_logits(hidden).float().cpu())
    return torch.cat(out)


def paged_perplexity(llm: LLM, token_ids: list[int], chunk: int) -> float:
    """exp(mean NLL of tokens 1..N-1); later chunks read earlier chunks' K/V from the pages."""
    logits = paged_logits(llm, token_ids, chunk)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(token_ids[1:]))
    return math.exp(float(nll))


def teacher_forced_agreement(llm: LLM, prompt_ids: list[list[int]], reference: list[list[int]]) -> float:
    """Share of positions where this KV dtype's argmax equals the float32 greedy token, given the
    float32 continuation as context (so one early flip does not decide all later positions)."""
    same = total = 0
    for ids, ref in zip(prompt_ids, reference):
        logits = paged_logits(llm, ids + ref[:-1], chunk=len(ids) + len(ref))
        predicted = logits[len(ids) - 1 :].argmax(dim=-1).tolist()
        same += sum(a == b for a, b in zip(predicted, ref))
        total += len(ref)
    return round(same / total, 4)


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    total = sum(len(r) for r in reference)
    same = sum(a == b for r, o in zip(reference, other) for a, b in zip(r, o))
    before = 0
    for r, o in zip(reference, other):
        n = next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r))
        before += n
    return {"positionwise": round(same / total, 4), "before_first_divergence": round(before / total, 4),
            "identical_sequences": sum(r == o for r, o in zip(reference, other))}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", action="append", choices=[c[0] for c in CONFIGS[1:]],
                        help="run float32 and this config (repeatable); needs --out")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.only and args.out == RESULTS:
        parser.error("--only writes a partial result: give --out another path")
    configs = [c for c in CONFIGS if not args.only or c[0] == "float32" or c[0] in args.only]
    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, tokens = {}, {}
    for label, kv_dtype, transform in configs:
        start = time.perf_counter()
        compute = transform.removeprefix("compute:") if transform.startswith("compute:") else None
        llm = LLM(kv_cache_dtype=kv_dtype, num_blocks=256, enable_prefix_caching=False,
                  dtype=compute or "float32")
        cache = llm.engine.runner.kv_cache
        if transform == "unscaled":  # set_scales without offsets or rotation: zero and identity
            cache.set_scales(torch.ones_like(cache.k_scales), torch.ones_like(cache.v_scales))
        elif transform in ("scales only", "rotated"):
            arch = llm.engine.loaded.arch_config
            other = calibrate_kv_scales(
                llm.engine.runner.model, calibration_segments(llm.engine.processor.encode_prompt),
                arch.num_hidden_layers, arch.num_key_value_heads,
                smooth=transform == "rotated", rotate=transform == "rotated")
            cache.set_scales(other.k, other.v, k_offsets=other.k_offset, v_offsets=other.v_offset,
                             rotation=other.rotation)
        text_ids = llm.engine.processor.encode_prompt(TEXT.read_text())
        ppl = paged_perplexity(llm, text_ids, args.chunk)
        prompt_ids = prompts(llm)
        outs = llm.generate(prompt_ids, params, use_tqdm=False)
        tokens[label] = [o.outputs[0].token_ids for o in outs]
        forced = teacher_forced_agreement(llm, prompt_ids, tokens["float32"])
        rows[label] = {"kv_cache_dtype": kv_dtype, "bytes_per_token": cache.bytes_per_token,
                       "perplexity": round(ppl, 4), "text_tokens": len(text_ids),
                       "teacher_forced_agreement_vs_float32": forced,
                       "wall_s": round(time.perf_counter() - start, 1)}
        print(label, rows[label], flush=True)
        del llm, cache
        gc.collect()
    base = rows["float32"]["perplexity"]
    for label, row in rows.items():
        row["perplexity_vs_float32"] = round(row["perplexity"] / base - 1, 5)
        row["agreement_vs_float32"] = agreement(tokens["float32"], tokens[label])
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "num_prompts": 16,
              "max_tokens": args.max_tokens, "chunk": args.chunk, "configs": rows}
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
