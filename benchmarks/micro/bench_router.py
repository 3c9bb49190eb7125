"""W1 across 2 replicas through `kvmemo router`: prefix-aware routing vs round robin.

Workload (W1): a shared ~1,024-token system prompt + distinct ~32-token questions, greedy, a
fixed number of output tokens, sent concurrently. With --num-prefixes N > 1 the questions are
split over N different system prompts (interleaved), the case where routing matters most.

Both routers run side by side in front of the same two replicas; runs alternate between the
policies (each run on freshly reset prefix caches and with its own system prompts), so the ratio
is measured under the same machine load. Writes benchmarks/results/router.json.

    python -m benchmarks.micro.bench_router                 # W1 as specified
    python -m benchmarks.micro.bench_router --num-questions 16 --system-tokens 512 --output-tokens 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.paths import RESULTS, ROOT
from benchmarks.server_process import running_server
from tests.redis_server import free_port  # one definition, shared with the tests


def process(args: list[str], port: int, env: dict[str, str]):
    """`python -m kvmemo.cli ARGS --port PORT` until /health answers 200; stopped on exit."""
    return running_server([sys.executable, "-m", "kvmemo.cli", *args, "--port", str(port)], port, env)


def system_prompt(tag: str, num_tokens: int) -> str:
    # ~8 tokens per sentence with the SmolLM2 tokenizer; the tag makes every run's prefix unique.
    sentences = [f"Rule {i}: answer in the style of manual {tag} section {i}." for i in range(num_tokens // 14)]
    return f"You are assistant {tag}. " + " ".join(sentences) + "\n"


def question(i: int) -> str:
    return f"Question {i}: in two short sentences, what does rule {i * 7 % 50} ask of you and why?"


def run_once(router_url: str, replicas: list[str], prompts: list[str], args) -> dict:
    for url in replicas:
        httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
    # The router must have seen the resets (AllBlocksCleared events) before the first request:
    # a late clear would wipe the blocks it predicts for the run's first requests.
    deadline = time.monotonic() + 30
    while any(r["cached_blocks"] for r in httpx.get(f"{router_url}/router/state").json()["replicas"]):
        if time.monotonic() > deadline:
            raise RuntimeError("the router never saw the prefix-cache resets")
        time.sleep(0.05)

    def send(prompt: str) -> tuple[dict, str]:
        r = httpx.post(
            f"{router_url}/v1/completions",
            json={"prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0,
                  "ignore_eos": True},
            timeout=600,
        )
        r.raise_for_status()
        return r.json()["usage"], r.headers["x-kvmemo-replica"]

    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(send, prompts))
    wall_s = time.perf_counter() - start
    prompt_tokens = sum(u["prompt_tokens"] for u, _ in results)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u, _ in results)
    output = sum(u["completion_tokens"] for u, _ in results)
    per_replica = {url: sum(1 for _, r in results if r == url) for url in replicas}
    return {
        "wall_s": round(wall_s, 2),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cached_fraction": round(cached / prompt_tokens, 4),
        "computed_prompt_tokens": prompt_tokens - cached,
        "output_tokens": output,
        "output_tok_s": round(output / wall_s, 2),
        "requests_per_replica": sorted(per_replica.values(), reverse=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-questions", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-prefixes", type=int, nargs="+", default=[1, 4],
                        help="system prompts the questions are split over (one scenario each)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per policy and scenario")
    parser.add_argument("--threads-per-replica", type=int, default=1)
    args = parser.parse_args()

    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(args.threads_per_replica))
    replica_flags = ["serve", "--num-blocks", "1024", "--max-model-len", "2048",
                     "--max-num-seqs", str(args.concurrency)]
    with contextlib.ExitStack() as stack:
        replicas = []
        for _ in range(2):
            events = f"tcp://127.0.0.1:{free_port()}"
            replicas.append(stack.enter_context(
                process([*replica_flags, "--kv-events-endpoint", events], free_port(), env)))
        routers = {}
        for policy in ("prefix", "round_robin"):
            flags = ["router", "--policy", policy, "--health-interval", "0.5"]
            for url in replicas:
                flags += ["--replica", url]
            routers[policy] = stack.enter_context(process(flags, free_port(), env))
        time.sleep(1.0)  # let the routers subscribe to the events

        scenarios = []
        for num_prefixes in args.num_prefixes:
            runs: dict[str, list[dict]] = {"prefix": [], "round_robin": []}
            for rep in range(args.repeats):
                for policy in (("prefix", "round_robin") if rep % 2 == 0 else ("round_robin", "prefix")):
                    tags = [uuid.uuid4().hex[:8] for _ in range(num_prefixes)]
                    prompts = [
                        system_prompt(tags[i % num_prefixes], args.system_tokens) + question(i)
                        for i in range(args.num_questions)
                    ]
                    # Arrival order independent of the prefix (a fixed seed: both policies see
                    # the same order), so round robin cannot line up with the prefixes by luck.
                    random.Random(rep).shuffle(prompts)
                    result = run_once(routers[policy], replicas, prompts, args)
                    print(f"{num_prefixes} prefix(es), {policy}: {result}", flush=True)
                    runs[policy].append(result)
            best = {p: max(r, key=lambda x: x["output_tok_s"]) for p, r in runs.items()}
            scenarios.append({
                "num_prefixes": num_prefixes,
                "runs": runs,
                "prefix_over_round_robin_throughput": round(
                    best["prefix"]["output_tok_s"] / best["round_robin"]["output_tok_s"], 3),
            })

    out = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads_per_replica": args.threads_per_replica,
            "python": platform.python_version(),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                     capture_output=True, text=True).stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "workload": {
            "num_questions": args.num_questions,
            "system_tokens": args.system_tokens,
            "output_tokens": args.output_tokens,
            "concurrency": args.concurrency,
            "replicas": 2,
        },
        "command": " ".join(["python -m benchmarks.micro.bench_router", *sys.argv[1:]]),
        "scenarios": scenarios,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "router.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / 'router.json'}")


if __name__ == "__main__":
    main()
