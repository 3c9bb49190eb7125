"""A production trace, scaled down, against `kvmemo serve`: real token prompts built to the
trace's block structure, one server per eviction policy, the same prompts in the same order.

Each trace block (a hash id) becomes one engine block of `--block-size` tokens drawn from a
generator seeded by the id, so equal ids give equal token blocks and a request's prompt shares
exactly the prefix the trace says; the last block is cut to the request's length scaled by
block_size / trace block. The pool holds `--capacity-tokens / trace block` blocks, the trace's
capacity in its own blocks. Requests go one at a time with max_tokens 1 (the prefill is what a
policy changes), through /v1/completions with token-id prompts; the server's usage says how many
prompt tokens came from the cache.

    python -m benchmarks.traces.serve_replay ../shared/traces/mooncake/conversation_trace.jsonl \
        --capacity-tokens 1000000 [--limit 2000] [--policies lru,aged-arc]

Writes benchmarks/results/serve_replay.json: per policy, prompt tokens, computed (uncached)
tokens, hit ratio, mean and p50 / p90 time to the first token, and the pool replay's hit ratio
for the same requests (benchmarks/traces/replay.py) beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request

from benchmarks.machine_info import cpu_label
from benchmarks.paths import RESULTS
from benchmarks.runners.agent_api_loop import _free_port
from benchmarks.server_process import running_server
from benchmarks.traces.replay import replay_pool
from benchmarks.traces.trace import BLOCK_TOKENS, TraceRequest, read_trace

VOCAB = (1000, 40000)  # ordinary token ids of the bundled model's vocabulary


def prompt_tokens(request: TraceRequest, block_size: int, trace_block: int) -> list[int]:
    tokens: list[int] = []
    for hash_id in request.hash_ids:
        rng = random.Random(hash_id)
        tokens += [rng.randrange(*VOCAB) for _ in range(block_size)]
    last = request.input_length - (len(request.hash_ids) - 1) * trace_block
    keep = max(1, -(-last * block_size // trace_block))  # the last block, scaled, rounded up
    return tokens[: (len(request.hash_ids) - 1) * block_size + min(keep, block_size)]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def run_policy(policy: str, prompts: list[list[int]], num_blocks: int, block_size: int) -> dict:
    port = _free_port()
    command = [sys.executable, "-m", "kvmemo.cli", "serve", "--port", str(port),
               "--served-model-name", "replay", "--max-model-len", "8192",
               "--num-blocks", str(num_blocks), "--block-size", str(block_size),
               "--eviction-policy", policy]
    prompt_total = cached_total = 0
    ttfts: list[float] = []
    with running_server(command, port) as url:
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            reply = _post(f"{url}/v1/completions", {"model": "replay", "prompt": prompt,
                                                    "max_tokens": 1, "temperature": 0.0})
            ttfts.append(time.perf_counter() - start)
            usage = reply["usage"]
            prompt_total += usage["prompt_tokens"]
            cached_total += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            if (i + 1) % 200 == 0:
                print(f"  {policy}: {i + 1}/{len(prompts)} requests, hit ratio "
                      f"{cached_total / prompt_total:.3f}", flush=True)
    ttfts.sort()
    return {"policy": policy, "prompt_tokens": prompt_total, "cached_tokens": cached_total,
            "computed_tokens": prompt_total - cached_total,
            "hit_ratio": round(cached_total / max(prompt_total, 1), 4),
            "ttft_mean_s": round(statistics.fmean(ttfts), 4),
            "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4),
            "ttft_p90_s": round(ttfts[int(len(ttfts) * 0.9)], 4),
            "wall_s": round(sum(ttfts), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--capacity-tokens", type=int, required=True,
                        help="the trace's capacity, in its own tokens")
    parser.add_argument("--limit", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--policies", default="lru,aged-arc")
    args = parser.parse_args(argv)
    fmt, requests = read_trace(args.trace, limit=args.limit)
    trace_block = BLOCK_TOKENS[fmt]
    num_blocks = args.capacity_tokens // trace_block
    prompts = [prompt_tokens(r, args.block_size, trace_block) for r in requests]
    result: dict = {"machine": cpu_label(), "trace": args.trace, "requests": len(requests),
                    "capacity_tokens": args.capacity_tokens, "num_blocks": num_blocks,
                    "block_size": args.block_size, "runs": []}
    for policy in args.policies.split(","):
        row = run_policy(policy, prompts, num_blocks, args.block_size)
        row["pool_replay_block_hit_ratio"] = round(
            replay_pool(requests, num_blocks, trace_block, policy=policy).block_hit_ratio, 4)
        print(json.dumps(row), flush=True)
        result["runs"].append(row)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serve_replay.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
