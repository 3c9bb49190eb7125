"""kvmemo core benchmarks on the bundled SmolLM2: decode, prefill, concurrency, prefix-cache hits.

Writes benchmarks/results/core.json and regenerates docs/benchmarks.md from it. Speed lives here,
never in tests. Run: `make bench` (or `python -m benchmarks.runners.run_core` from the repository
root).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.machine_info import cpu_label
from benchmarks.paths import RESULTS, ROOT
from kvmemo import LLM, SamplingParams

WORDS = ("river stone light market garden window paper silver engine forest music winter "
         "harbor letter mountain coffee station orange bridge candle").split()


def random_token_prompt(llm: LLM, num_tokens: int, seed: int) -> list[int]:
    """A prompt of exactly num_tokens tokens of plain words, distinct per seed from its first
    token on (so distinct seeds share no prefix, not even a partial block)."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(num_tokens * 2))
    ids = llm.engine.processor.encode_prompt(text)
    return [1000 + seed % 40000] + ids[: num_tokens - 1]


def timed_generate(llm: LLM, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def bench_decode(llm: LLM) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    prompt = random_token_prompt(llm, 32, seed=1)
    llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    wall, outs = timed_generate(llm, [prompt], params)
    ttft = outs[0].metrics.ttft_s
    return {"decode_tok_s_1_request": round(127 / (wall - ttft), 1), "decode_ms_per_token": round((wall - ttft) / 127 * 1000, 2)}


def bench_prefill(make_llm) -> dict:
    llm = make_llm(enable_prefix_caching=False)
    prompt = random_token_prompt(llm, 1000, seed=2)
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
    times = []
    for _ in range(3):
        _, outs = timed_generate(llm, [prompt], SamplingParams(max_tokens=1))
        times.append(outs[0].metrics.ttft_s)
    return {"prefill_tok_s_1000": round(1000 / min(times), 1), "ttft_cold_1000_s": round(min(times), 3)}


def bench_cached_prefix(llm: LLM) -> dict:
    """TTFT of a ~1,000-token prompt whose first 1,000 tokens are cached vs cold."""
    prefix = random_token_prompt(llm, 1000, seed=3)
    cold, warm = [], []
    for trial in range(3):
        llm.reset_prefix_cache()
        suffix_a = random_token_prompt(llm, 24, seed=100 + trial)
        suffix_b = random_token_prompt(llm, 24, seed=200 + trial)
        _, a = timed_generate(llm, [prefix + suffix_a], SamplingParams(max_tokens=1))
        _, b = timed_generate(llm, [prefix + suffix_b], SamplingParams(max_tokens=1))
        cold.append(a[0].metrics.ttft_s)
        warm.append(b[0].metrics.ttft_s)
    return {
        "ttft_cold_1024_s": round(min(cold), 4),
        "ttft_cached_1000_of_1024_s": round(min(warm), 4),
        "cached_over_cold": round(min(warm) / min(cold), 3),
    }


def bench_concurrent_zero_hit(make_llm, num_requests: int = 32, rounds: int = 3) -> dict:
    """32 requests of 256 distinct prompt tokens + 64 output tokens, prefix caching on vs off.

    Both engines are built and warmed first, then timed in alternating order (on/off, off/on, ...):
    timing all of one mode first measured the process's history (run right after the prefill
    benchmark, caching on came out 12.6% slower; alone, each mode took the same 22 s).
    """
    llms = {mode: make_llm(enable_prefix_caching=mode == "caching_on")
            for mode in ("caching_on", "caching_off")}
    prompts = [random_token_prompt(llms["caching_on"], 256, seed=1000 + i) for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    walls: dict[str, list[float]] = {mode: [] for mode in llms}
    for round_index in range(rounds):
        for mode in sorted(llms, reverse=round_index % 2 == 1):
            llms[mode].reset_prefix_cache()
            wall, outs = timed_generate(llms[mode], prompts, params)
            assert sum(o.metrics.num_cached_tokens for o in outs) == 0  # 0% hit rate by construction
            walls[mode].append(wall)
    result: dict = {}
    for mode, times in walls.items():
        wall = min(times)
        result[mode] = {"wall_s": round(wall, 2), "output_tok_s": round(num_requests * 64 / wall, 1),
                        "total_tok_s": round(num_requests * (256 + 64) / wall, 1),
                        "runs_s": [round(t, 2) for t in times]}
    on, off = result["caching_on"]["wall_s"], result["caching_off"]["wall_s"]
    result["on_over_off_slowdown"] = round(on / off - 1, 4)
    return result


def bench_hashing() -> dict:
    from kvmemo.kv.hashing import hash_block, namespace_root_hash

    out = {}
    tokens = list(range(16))
    for algorithm in ("sha256", "xxh3_128"):
        root = namespace_root_hash(weights_fingerprint="x", kv_cache_dtype="float32", block_size=16, algorithm=algorithm)
        n_blocks = 62_500  # one million tokens
        start = time.perf_counter()
        parent = root
        for _ in range(n_blocks):
            parent = hash_block(parent, tokens, (), algorithm)
        out[f"hash_ms_per_million_tokens_{algorithm}"] = round((time.perf_counter() - start) * 1000, 1)
    return out


def machine() -> dict:
    return {"cpu": cpu_label(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "commit": _git_commit()}


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(RESULTS / "core.json"))
    args = parser.parse_args()

    def make_llm(**kw) -> LLM:
        return LLM(kv_cache_memory="2GiB", **kw)

    results: dict = {"machine": machine()}
    llm = make_llm()
    results["decode"] = bench_decode(llm)
    print(results["decode"], flush=True)
    results["cached_prefix"] = bench_cached_prefix(llm)
    print(results["cached_prefix"], flush=True)
    del llm
    results["prefill"] = bench_prefill(make_llm)
    print(results["prefill"], flush=True)
    results["concurrent_32_zero_hit"] = bench_concurrent_zero_hit(make_llm)
    print(results["concurrent_32_zero_hit"], flush=True)
    results["hashing"] = bench_hashing()
    print(results["hashing"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    subprocess.run([sys.executable, "-m", "benchmarks.report.write_docs"], check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
