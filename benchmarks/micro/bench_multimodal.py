"""Multimodal prefix caching benchmark (the upstream vLLM one, scaled to this machine).

    python -m benchmarks.micro.bench_multimodal [--num-prompts 100] [--hit-rate 0.3] [--rounds 3]

A random LLaVA (CLIP vision tower 112 px / patch 14 -> 64 image tokens, 4 layers, 192 wide; Llama
text model, 6 layers, 512 wide; the SmolLM2 tokenizer plus <image>) is built on the fly. Few output
tokens, so the prompt (image) prefill dominates, as it does for real VLM requests. Workload:
N prompts "USER: <image>\\n<question> ASSISTANT:", a fraction `hit_rate` of them repeating an
earlier prompt's image and question, each repeat right after its original ("repeats grouped
together", the best locality, as upstream). All N go in one generate() call (continuous batching).

Modes, interleaved round by round in one process (ratios survive a loaded machine best):
prefix caching on / off at the given hit rate, and on / off at a 0% hit rate (the overhead of
hashing image content into blocks when nothing is reused). Both caches (KV and encoder) are
emptied before every run, so each run starts cold. Writes benchmarks/results/multimodal.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.paths import RESULTS
from benchmarks.runners.run_core import machine
from kvmemo import LLM, SamplingParams
from kvmemo.intake.prompt_input import PromptInput
from tests.multimodal.tiny_llava import save_random_llava

QUESTIONS = [
    "What is shown in this picture?",
    "Describe the colours and the shapes you can see.",
    "Is there a person in the image? Explain.",
    "Write a short caption for this photograph.",
    "Which objects are in the foreground?",
]


def build_model(directory: Path) -> None:
    save_random_llava(
        directory,
        image_size=112,
        patch_size=14,
        vision=dict(
            hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4
        ),
        text=dict(
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=2048,
        ),
    )


def workload(num_prompts: int, hit_rate: float, seed: int) -> list[dict]:
    """num_prompts requests; round(num_prompts * hit_rate) of them repeat the one before."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    num_repeats = round(num_prompts * hit_rate)
    num_unique = num_prompts - num_repeats
    prompts: list[dict] = []
    for i in range(num_unique):
        pixels = rng.integers(0, 256, (160, 200, 3), dtype=np.uint8)
        prompt = {
            "prompt": f"USER: <image>\n{QUESTIONS[i % len(QUESTIONS)]} ASSISTANT:",
            "images": [Image.fromarray(pixels, "RGB")],
        }
        prompts.append(prompt)
        if i < num_repeats:
            prompts.append(prompt)  # the repeat, grouped with its original
    return prompts


def run(llm: LLM, prompts: list[dict], params: SamplingParams) -> dict:
    llm.reset_prefix_cache()
    llm.engine.runner.encoder_cache.clear()
    before = llm.get_metrics()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    after = llm.get_metrics()
    return {
        "wall_s": wall_s,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "num_prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "num_cached_tokens": sum(o.metrics.num_cached_tokens for o in outs),
        "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "encoder_images": after.mm_encoder_images - before.mm_encoder_images,
    }


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def hashing_cost(llm: LLM, prompts: list[dict]) -> dict:
    """What prefix caching adds per request when nothing hits, timed alone (robust to load):
    block hashes with image extra keys. Preprocessing and the image content hash run in both
    modes (the hash is what makes a picture cacheable at all), timed too for scale."""
    engine = llm.engine
    start = time.perf_counter()
    processed = [engine.processor.process(PromptInput(prompt=p["prompt"], images=p["images"]))
                 for p in prompts]
    process_s = time.perf_counter() - start
    hasher = engine.layout.new_hasher()
    start = time.perf_counter()
    for p in processed:
        hasher.hash_prompt(p.token_ids, mm_items=p.mm_items)
    hash_s = time.perf_counter() - start
    return {
        "num_requests": len(prompts),
        "num_blocks_hashed": hasher.num_hashed_blocks,
        "block_hashing_us_per_request": round(hash_s / len(prompts) * 1e6, 1),
        "preprocess_and_content_hash_ms_per_image": round(process_s / len(prompts) * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--hit-rate", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(RESULTS / "multimodal.json"))
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="kvmemo-llava-"))
    build_model(directory)
    options = {"model": str(directory), "device": args.device, "num_blocks": 4096}
    engines = {"on": LLM(**options), "off": LLM(**options, enable_prefix_caching=False)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    workloads = {
        "hit": workload(args.num_prompts, args.hit_rate, seed=1),
        "zero": workload(args.num_prompts, 0.0, seed=2),
    }
    run(engines["on"], workloads["zero"][:4], params)  # warm-up: allocator, kernels
    run(engines["off"], workloads["zero"][:4], params)
    runs: dict[str, list[dict]] = {f"{w}_{m}": [] for w in workloads for m in engines}
    for round_index in range(args.rounds):
        order = ["on", "off"] if round_index % 2 == 0 else ["off", "on"]  # no order bias
        for w, prompts in workloads.items():
            for m in order:
                runs[f"{w}_{m}"].append(run(engines[m], prompts, params))
    for w in workloads:  # caching must never change a greedy token
        assert runs[f"{w}_on"][0]["tokens"] == runs[f"{w}_off"][0]["tokens"], f"{w}: tokens differ"

    def summary(key: str) -> dict:
        best = min(runs[key], key=lambda r: r["wall_s"])
        return {
            "wall_s_best": round(best["wall_s"], 3),
            "wall_s_median": round(median([r["wall_s"] for r in runs[key]]), 3),
            "wall_s_all": [round(r["wall_s"], 3) for r in runs[key]],
            "requests_per_s": round(args.num_prompts / best["wall_s"], 2),
            "prompt_tok_s": round(best["num_prompt_tokens"] / best["wall_s"], 1),
            "num_prompt_tokens": best["num_prompt_tokens"],
            "num_cached_tokens": best["num_cached_tokens"],
            "encoder_images": best["encoder_images"],
        }

    result = {
        "machine": machine(),
        "config": {
            "num_prompts": args.num_prompts,
            "hit_rate": args.hit_rate,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "image_tokens": 64,
            "block_size": 16,
            "model": "random LLaVA: CLIP 112px/14 (4 layers, 192 wide), Llama (6 layers, 512 wide)",
        },
        **{key: summary(key) for key in runs},
    }

    def paired(w: str) -> list[float]:  # off / on wall time, per round (same load moment)
        return [off["wall_s"] / on["wall_s"] for on, off in zip(runs[f"{w}_on"], runs[f"{w}_off"])]

    result["speedup_at_hit_rate"] = round(median(paired("hit")), 3)
    result["speedup_at_hit_rate_rounds"] = [round(x, 3) for x in paired("hit")]
    result["overhead_at_zero_hit"] = round(1 / median(paired("zero")) - 1, 4)
    result["overhead_at_zero_hit_rounds"] = [round(1 / x - 1, 4) for x in paired("zero")]
    result["hashing"] = hashing_cost(engines["on"], workloads["zero"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
