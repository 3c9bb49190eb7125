"""Run one workload on one engine and write one result JSON (the same schema for every engine).

    python -m benchmarks.runners.run --engine kvmemo --workload W1 \
        --out benchmarks/results/peers/kvmemo-W1.json
    python -m benchmarks.runners.run --engine llama.cpp --model PATH.gguf --workload W1 \
        --mode online --rate 2 --out benchmarks/results/peers/llama.cpp-W1-online.json

Invariant: every engine gets the identical token ids from benchmarks/generated_workloads/<W>.json,
greedy, exactly max_tokens output tokens each (EOS ignored), and is timed by this module's clock.

Peers run in their own virtualenvs (benchmarks/peers/setup_*.sh), which have neither kvmemo nor
torch: runners.run_suite starts this module there as `<peer python> -m benchmarks.runners.run`
with the repository root as cwd, so `benchmarks` is imported from the checkout exactly as under
kvmemo's own python (one way, no path setup). That works because everything this module imports
at module level (benchmarks/__init__, paths, machine_info, workloads, runners/__init__,
runners/engines/base) uses the standard library only; each engine is imported inside its runner's
make_runner(). Keep it so: tests/benchmarks/test_layout.py imports this chain with torch,
numpy, transformers and kvmemo blocked.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

from benchmarks.machine_info import cpu_label
from benchmarks.paths import GENERATED_WORKLOADS
from benchmarks.runners.engines.base import Completion, EngineRunner
from benchmarks.workloads import WORKLOADS, Workload

ENGINES = {"kvmemo": "benchmarks.runners.engines.kvmemo_runner",
           "llama.cpp": "benchmarks.runners.engines.llamacpp_runner",
           "vllm": "benchmarks.runners.engines.vllm_runner", "hf": "benchmarks.runners.engines.hf_runner"}


def load_workload(name: str, directory: Path) -> Workload:
    path = directory / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `python -m benchmarks.workloads --out {directory}` first")
    return Workload.from_json(path.read_text())


def arrival_offsets(num_requests: int, mode: str, rate: float) -> list[float]:
    """Offline: everything at t=0. Online: a fixed rate (deterministic spacing, not Poisson, so
    every engine sees the very same schedule)."""
    if mode == "offline":
        return [0.0] * num_requests
    return [i / rate for i in range(num_requests)]


def run_prompts(runner: EngineRunner, workload: Workload, offsets: list[float]) -> list[Completion]:
    prompts = [r["prompt_token_ids"] for r in workload.requests]
    return runner.run(prompts, offsets, workload.max_tokens)


def run_conversations(runner: EngineRunner, workload: Workload, mode: str, rate: float) -> list[Completion]:
    """W2: turn t of every conversation is submitted together once turn t-1 has answered; each
    prompt is the previous prompt + the engine's own answer + the end-of-answer tokens + turn t."""
    contexts = [list(c["system_token_ids"]) for c in workload.conversations]
    num_turns = len(workload.conversations[0]["user_segments"])
    done: list[Completion] = []
    for turn in range(num_turns):
        prompts = []
        for context, conversation in zip(contexts, workload.conversations):
            context += conversation["user_segments"][turn]
            prompts.append(list(context))
        completions = runner.run(prompts, arrival_offsets(len(prompts), mode, rate), workload.max_tokens)
        for context, completion in zip(contexts, completions):
            context += completion.token_ids + workload.answer_end_token_ids
        done += completions
    return done


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def machine() -> dict:
    return {"cpu": cpu_label(), "cores": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M")}


def summarize(runner: EngineRunner, workload: Workload, mode: str, rate: float,
              completions: list[Completion], wall_s: float) -> dict:
    output_tokens = sum(len(c.token_ids) for c in completions)
    cached = [c.num_cached_tokens for c in completions]
    ttft = [c.ttft_s for c in completions]
    latency = [c.latency_s for c in completions]
    return {
        "engine": runner.name, "engine_version": runner.version, "options": runner.options,
        "workload": workload.name, "workload_description": workload.description, "mode": mode,
        "rate_per_s": rate if mode == "online" else None, "num_requests": len(completions),
        "wall_s": round(wall_s, 3), "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / wall_s, 2),
        "prompt_tokens": sum(c.num_prompt_tokens for c in completions),
        "cached_prompt_tokens": None if None in cached else sum(cached),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "ttft_mean_s": round(statistics.fmean(ttft), 4),
        "latency_p50_s": percentile(latency, 50), "latency_p90_s": percentile(latency, 90),
        "startup_s": round(runner.startup_s, 2), "machine": machine(),
        "output_token_ids": [c.token_ids for c in completions],  # to compare engines' answers
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run one benchmark workload on one engine.")
    parser.add_argument("--engine", required=True, choices=sorted(ENGINES))
    parser.add_argument("--workload", required=True, choices=WORKLOADS)
    parser.add_argument("--mode", choices=("offline", "online"), default="offline",
                        help="offline: all requests at once (throughput); online: fixed arrival rate")
    parser.add_argument("--rate", type=float, default=2.0, help="online arrivals per second")
    parser.add_argument("--model", default=None, help="GGUF file (HF directory for vllm)")
    parser.add_argument("--workload-dir", default=str(GENERATED_WORKLOADS))
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn the engine's prefix reuse off")
    parser.add_argument("--kv-store", default=None, help="kvmemo only: a persistent store (W4)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype (kvmemo, vllm; llama.cpp runs the GGUF's own types)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.rate <= 0:
        parser.error(f"--rate must be > 0, got {args.rate}")
    workload = load_workload(args.workload, Path(args.workload_dir))
    start = time.perf_counter()
    runner: EngineRunner = importlib.import_module(ENGINES[args.engine]).make_runner(
        model=args.model, prefix_caching=not args.no_prefix_caching, threads=args.threads,
        kv_store=args.kv_store, dtype=args.dtype)
    runner.startup_s = time.perf_counter() - start
    runner.warm_up()
    start = time.perf_counter()
    if workload.conversations:
        completions = run_conversations(runner, workload, args.mode, args.rate)
    else:
        completions = run_prompts(runner, workload, arrival_offsets(len(workload.requests), args.mode, args.rate))
    wall_s = time.perf_counter() - start
    result = summarize(runner, workload, args.mode, args.rate, completions, wall_s)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{runner.name} {workload.name} {args.mode}: {result['wall_s']} s, {result['output_tok_s']} "
          f"output tok/s, TTFT p50 {result['ttft_p50_s']} s, cached {result['cached_prompt_tokens']}")


if __name__ == "__main__":
    main()
