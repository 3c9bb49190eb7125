"""Every eviction policy at every capacity of a trace: the table that chose the pool's default.

    python -m benchmarks.traces.sweep ../shared/traces/mooncake/conversation_trace.jsonl \
        [--capacities-m 0.5,1,3,10,50] [--decode-ms-per-token 0] [--json-out FILE]

Prints a markdown table of token hit ratios (one row per policy, then Belady's optimum at each
capacity and each policy's ratio to LRU) and writes the figures as JSON with the commit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

from benchmarks.traces.replay import POLICIES, belady, replay_pool
from benchmarks.traces.trace import BLOCK_TOKENS, read_trace

CAPACITIES_M = "0.5,0.75,1,1.5,2,3,5,7.5,10,15,20,30,50"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--capacities-m", default=CAPACITIES_M,
                        help="capacities in millions of tokens, comma-separated")
    parser.add_argument("--decode-ms-per-token", type=float, default=0.0)
    parser.add_argument("--belady", action="store_true", help="add Belady's optimum (slower)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    fmt, requests = read_trace(args.trace)
    block = BLOCK_TOKENS[fmt]
    capacities = [float(c) for c in args.capacities_m.split(",")]
    blocks = [int(c * 1e6) // block for c in capacities]
    rows: dict[str, list[float]] = {}
    for policy in POLICIES:
        rows[policy] = [round(replay_pool(requests, n, block, args.decode_ms_per_token,
                                          policy).hit_ratio, 4) for n in blocks]
    if args.belady:
        rows["belady"] = [round(belady(requests, n, block).hit_ratio, 4) for n in blocks]
    print("| policy | " + " | ".join(f"{c:g}M" for c in capacities) + " |")
    print("|---|" + "---|" * len(capacities))
    for policy, ratios in rows.items():
        print(f"| {policy} | " + " | ".join(f"{r:.3f}" for r in ratios) + " |")
    for policy in POLICIES[1:]:
        print(f"| {policy} / lru | " + " | ".join(
            f"{r / max(base, 1e-9):.2f}x" for r, base in zip(rows[policy], rows["lru"])) + " |")
    if args.json_out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        with open(args.json_out, "w") as out:
            json.dump({"trace": args.trace, "format": fmt, "block_tokens": block,
                       "decode_ms_per_token": args.decode_ms_per_token, "commit": commit,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "capacities_m": capacities, "hit_ratio": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
