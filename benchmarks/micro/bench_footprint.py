"""Start-up and memory of one chat turn, kvmemo beside llama.cpp on the same GGUF, fresh processes.

    python -m benchmarks.micro.bench_footprint [--model smollm2] [--repeats 3]

Each run is a new process that loads the model with an 8,192-token context, generates 8 greedy
tokens for an 18-token prompt and exits. Reported per engine (median of --repeats, the engines
alternating): seconds from the process's start (before `import`) to the first token, and the
process's peak RSS. kvmemo runs with weights="native" (and, for reference, "dense"); llama.cpp
(llama-cpp-python, from benchmarks/peers/.venv-llamacpp) with n_ctx 8192 and 2 threads. The
children import only what their engine needs. Writes benchmarks/results/footprint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.machine_info import cpu_label
from benchmarks.paths import RESULTS

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers"
CONTEXT = 8192
TOKENS = 8
PROMPT = "The history of the river stone market began when"


def _child(engine: str, model: str, start: float) -> dict:
    """Runs in the child: load, generate, report (start = the parent's clock at launch)."""
    import resource

    if engine == "llama.cpp":
        import llama_cpp

        path = json.loads((RESULTS / f"{model}-prompts.json").read_text())["model"]
        llm = llama_cpp.Llama(model_path=path, n_ctx=CONTEXT, n_threads=2, verbose=False)
        ids = llm.tokenize(PROMPT.encode(), add_bos=True)
        first = None
        for count, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1), 1):
            first = first or time.time()
            if count == TOKENS:
                break
    else:
        weights = engine.split(":")[1]
        from kvmemo import LLM, SamplingParams
        from kvmemo.model.loading.loader import bundled_model_path, packaged_gemma3_path

        path = packaged_gemma3_path() if model == "gemma3-270m" else bundled_model_path()
        llm = LLM(path, weights=weights, max_model_len=CONTEXT)
        began = time.time()
        (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0),
                              use_tqdm=False)
        first = began + out.metrics.ttft_s
    return {"start_to_first_token_s": first - start,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _run(engine: str, model: str) -> dict:
    python = (PEERS / ".venv-llamacpp" / "bin" / "python" if engine == "llama.cpp"
              else Path(sys.executable))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.time()
    done = subprocess.run(
        [str(python), "-m", "benchmarks.micro.bench_footprint", "--child", engine,
         "--model", model, "--start", repr(start)],
        capture_output=True, text=True, env=env, cwd=ROOT, check=True, timeout=600,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["smollm2", "gemma3-270m"], default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.model, args.start)))
        return 0
    engines = ["kvmemo:native", "llama.cpp", "kvmemo:dense"]
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(args.repeats):
        for engine in engines:
            runs[engine].append(_run(engine, args.model))
            print(engine, runs[engine][-1], flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_label(),
        "model": args.model, "context": CONTEXT, "tokens": TOKENS, "repeats": args.repeats,
        "engines": {
            engine: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            for engine, rows in runs.items()
        },
    }
    (RESULTS / "footprint.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
