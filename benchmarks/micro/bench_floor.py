"""W1 against its matmul floor: the workload's linear-layer FLOPs over the best GEMM rate the
engine's own kernels reach on this machine, per dtype (issue 15's goal: wall at most 1.5x it).

    python -m benchmarks.micro.bench_floor [--dtypes float32,bfloat16] [--repeats 3]

FLOPs: every token the decoder layers compute (prompt tokens the prefix cache did not serve,
and each decode step's token) costs 2 x the layer weights' elements, and every sampled row
2 x the lm_head's. Attention's FLOPs (q.k and p.v of each query over its keys, up to the query:
causal) are counted apart. Two floors come of them: the linear floor (the linear FLOPs only;
the wall pays for attention on top) and the step floor (all of the steps' FLOPs, linear and
attention, at the same GEMM rate: the issue's "step's FLOPs over the best GEMM rate"). The GEMM rate is measured in the
same process, after the engine has bound its kernels: each of layer 0's projections (and the
head) through the engine's own Linear, at 32 rows (a decode step's shape) and 1,024 rows
(prefill), best of 10 calls each; the best rate of all is the floor's rate. W1 then runs in the
same engine (one warm-up run, then --repeats timed runs, the prefix cache reset before each).
Writes benchmarks/results/w1_floor.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from benchmarks.machine_info import cpu_label
from benchmarks.paths import RESULTS
from benchmarks.workloads import build_workload, bundled_tokenizer

OUT = RESULTS / "w1_floor.json"
ROWS = (32, 1024)


def gemm_rates(model, dtype: torch.dtype) -> dict[str, float]:
    """GFLOP/s of the engine's bound kernels on layer 0's projections and the head, per rows."""
    layer = model.layers[0]
    linears = {"qkv": layer.qkv, "o": layer.o, "gate": layer.mlp.gate, "up": layer.mlp.up,
               "down": layer.mlp.down, "head": model.head}
    rates = {}
    for name, linear in linears.items():
        out_features, in_features = linear.dense().shape
        # The head sees fp32 rows (the final norm's output); the projections the compute dtype.
        x_dtype = torch.float32 if name == "head" else dtype
        for rows in ROWS:
            x = torch.randn(rows, in_features).to(x_dtype)
            linear(x)
            best = float("inf")
            for _ in range(10):
                start = time.perf_counter()
                linear(x)
                best = min(best, time.perf_counter() - start)
            rates[f"{name} x{rows}"] = 2 * rows * in_features * out_features / best / 1e9
    return rates


def run_w1(engine, workload) -> tuple[float, list[tuple[int, int, int]]]:
    """One W1 run (all requests at once): wall seconds and, per request, (prompt tokens,
    of them served by the prefix cache, tokens generated)."""
    from kvmemo import SamplingParams

    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True)
    tag = time.perf_counter_ns()
    for i, request in enumerate(workload.requests):
        prompt = engine.processor.process(list(request["prompt_token_ids"]))
        engine.add_request(f"{tag}-{i}", prompt, params)
    done: dict[int, tuple[int, int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                index = int(out.request_id.rsplit("-", 1)[1])
                done[index] = (out.metrics.num_cached_tokens, len(out.outputs[0].token_ids))
    wall = time.perf_counter() - start
    return wall, [(len(r["prompt_token_ids"]), *done[i]) for i, r in enumerate(workload.requests)]


def count_flops(requests: list[tuple[int, int, int]], model, arch) -> dict[str, float]:
    """Linear FLOPs (2 x weights per computed row; the head per sampled row) and attention's
    (q.k and p.v of each computed query over the keys up to it), all layers."""
    layer = model.layers[0]
    layer_params = sum(lin.dense().numel() for lin in (layer.qkv, layer.o, layer.mlp.gate,
                                                        layer.mlp.up, layer.mlp.down))
    head_params = model.head.dense().numel()
    layer_rows = sampled = keys = 0
    for prompt, cached, generated in requests:
        # Computed positions: the prompt past its cache hit, then every generated token but
        # the last (each is fed back by the next decode step).
        positions = range(cached, prompt + generated - 1)
        layer_rows += len(positions)
        sampled += generated
        keys += sum(p + 1 for p in positions)
    per_key = 4 * arch.num_attention_heads * arch.head_dim * arch.num_hidden_layers
    return {"layer_rows": layer_rows, "sampled_rows": sampled,
            "linear": 2 * layer_rows * layer_params * arch.num_hidden_layers
            + 2 * sampled * head_params,
            "attention": per_key * keys}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from kvmemo.config import EngineConfig
    from kvmemo.engine import Engine

    workload = build_workload("W1", bundled_tokenizer())
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_label(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "dtypes": {}}
    for name in args.dtypes.split(","):
        engine = Engine(EngineConfig.from_kwargs(dtype=name, weights="dense"))
        model, arch = engine.runner.model, engine.loaded.arch_config
        rates = gemm_rates(model, engine.loaded.dtype)
        best = max(rates.values())
        run_w1(engine, workload)  # warm-up
        walls = []
        for _ in range(args.repeats):
            wall, requests = run_w1(engine, workload)
            walls.append(wall)
        flops = count_flops(requests, model, arch)
        floor = flops["linear"] / (best * 1e9)
        step_floor = (flops["linear"] + flops["attention"]) / (best * 1e9)
        wall = statistics.median(walls)
        result["dtypes"][name] = {
            "walls_s": [round(w, 3) for w in walls], "wall_s": round(wall, 3),
            "gemm_gflops": {k: round(v, 1) for k, v in rates.items()},
            "best_gemm_gflops": round(best, 1),
            "layer_rows": flops["layer_rows"], "sampled_rows": flops["sampled_rows"],
            "linear_gflop": round(flops["linear"] / 1e9, 1),
            "attention_gflop": round(flops["attention"] / 1e9, 1),
            "floor_s": round(floor, 3), "wall_over_floor": round(wall / floor, 2),
            "step_floor_s": round(step_floor, 3),
            "wall_over_step_floor": round(wall / step_floor, 2),
        }
        print(name, json.dumps(result["dtypes"][name]), flush=True)
        del engine, model
        gc.collect()
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
