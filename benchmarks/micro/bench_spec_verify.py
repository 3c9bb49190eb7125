"""The verification cost curve of speculative decoding: the wall time of one engine step that
verifies k drafted tokens (k + 1 rows) for one sequence, k = 0..16, against k = 0 (a plain
decode step), for native and dense weights.

    python -m benchmarks.micro.bench_spec_verify [--weights native,dense] [--context 512]
                                                  [--repeats 15] [--max-k 16]

A 512-token prompt is prefilled once; then each measured step carries a draft of k tokens the
model will not take (random ids), so nothing is kept and the sequence stays at the same length
for every k: the step computes k + 1 rows over the same cache. Steps for the k values are
interleaved (k = 0, 1, ..., max, 0, 1, ...) and medians reported. A draft of k tokens pays when
the tokens it keeps on average exceed cost(k) / cost(0) - 1. Writes
benchmarks/results/spec_verify.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from benchmarks.machine_info import cpu_label
from benchmarks.paths import RESULTS
from kvmemo import SamplingParams
from kvmemo.config import EngineConfig
from kvmemo.engine.engine import Engine


def step_costs(weights: str, context: int, repeats: int, max_k: int) -> dict[int, float]:
    engine = Engine(EngineConfig(weights=weights, speculative_config={"method": "ngram"}))
    rng = random.Random(0)
    vocab = engine.processor.vocab_size
    prompt = engine.processor.process([rng.randrange(100, vocab) for _ in range(context)])
    engine.add_request("r", prompt, SamplingParams(max_tokens=10_000, temperature=0.0))
    engine.step()  # the prefill
    request = engine.scheduler.requests["r"]
    times: dict[int, list[float]] = {k: [] for k in range(max_k + 1)}
    for _ in range(repeats):
        for k in range(max_k + 1):
            request.draft_token_ids = [rng.randrange(100, vocab) for _ in range(k)]
            start = time.perf_counter()
            engine.step()
            times[k].append(time.perf_counter() - start)
            # Keep the context fixed: drop the step's token (its KV is rewritten next step).
            request.truncate_output(request.num_output_tokens - 1)
    engine.abort_request("r")
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="native,dense")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--max-k", type=int, default=16)
    args = parser.parse_args()
    results = {"cpu": cpu_label(), "context": args.context, "curves": {}}
    for weights in args.weights.split(","):
        costs = step_costs(weights, args.context, args.repeats, args.max_k)
        base = costs[0]
        results["curves"][weights] = {k: round(v * 1e3, 2) for k, v in costs.items()}
        print(f"{weights}: one step, ms (x plain decode)")
        for k, v in costs.items():
            print(f"  k={k:2d}  {v * 1e3:7.2f}  {v / base:5.2f}x")
    (RESULTS / "spec_verify.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
