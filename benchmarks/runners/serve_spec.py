"""Speculative decoding served: `vllm bench serve` on a copy-heavy set against `kvmemo serve`
with and without a speculative config, at concurrency 1 and 16 (issue 40: the gain at 1, no loss
at 16).

    python -m benchmarks.runners.serve_spec [--concurrency 1,16] [--repeats 1]
        [--speculative-config '{"method": "suffix", "num_speculative_tokens": 16}']

The set: bench_spec_decode's code edits (a Python file in the prompt, "rewrite the whole file and
rename X"), each of its 4 files with each of its 4 edits, 16 prompts, as vLLM's custom dataset
(chat template applied by the client, from the fp32 checkpoint converted for vLLM), up to 256
tokens out, greedy (--temperature 0: the replies are the same with and without speculation),
EOS honoured. kvmemo runs in its default mode (native weights; the benchmarks package defaults
to dense beside vLLM). One fresh server per run; plain and speculative alternate. Writes
benchmarks/results/serve_spec.json: per concurrency and config, the client's output tokens/s,
mean TPOT, mean TTFT and duration.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks.machine_info import cpu_label
from benchmarks.micro.bench_spec_decode import EDITS, FILES
from benchmarks.paths import RESULTS, ROOT
from benchmarks.runners.run_suite import PEER_PYTHON
from benchmarks.runners.serve_bench import CLIENT, HF_CHECKPOINT, server_command
from benchmarks.server_process import running_server

SUFFIX = '{"method": "suffix", "num_speculative_tokens": 16}'
KEPT = ("output_throughput", "mean_tpot_ms", "mean_ttft_ms", "duration", "completed",
        "total_output_tokens")


def write_dataset(path: Path) -> int:
    """The code-edit prompts as vLLM's custom JSONL; returns their count."""
    rows = [{"prompt": f"Here is a Python file:\n\n{code}\nRewrite the whole file and {edit}. "
                       "Output only the code."}
            for code in FILES for edit in EDITS]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def run_once(speculative: str | None, concurrency: int, dataset: Path, prompts: int, port: int,
             scratch: Path) -> dict:
    command, name = server_command("kvmemo", "float32", port)
    command += ["--max-model-len", "4096"]
    if speculative:
        command += ["--speculative-config", speculative]
    env = {**os.environ, "KVMEMO_WEIGHTS": "native"}
    out = f"{'spec' if speculative else 'plain'}-c{concurrency}.json"
    with running_server(command, port, env, timeout_s=600) as url:
        subprocess.run(
            [str(PEER_PYTHON["vllm"]), "-c", CLIENT, "--backend", "openai",
             "--endpoint", "/v1/completions", "--base-url", url, "--model", name,
             "--tokenizer", str(HF_CHECKPOINT), "--dataset-name", "custom",
             "--dataset-path", str(dataset), "--custom-output-len", "256",
             "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
             "--request-rate", "inf", "--temperature", "0", "--seed", "0",
             "--disable-shuffle", "--save-result", "--result-dir", str(scratch),
             "--result-filename", out],
            cwd=ROOT, check=True,
        )
    result = json.loads((scratch / out).read_text())
    return {key: result.get(key) for key in KEPT}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--speculative-config", default=SUFFIX, metavar="JSON")
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args()
    summary: dict = {"machine": cpu_label(), "speculative_config": args.speculative_config,
                     "runs": []}
    with tempfile.TemporaryDirectory(prefix="kvmemo-serve-spec-") as scratch:
        dataset = Path(scratch) / "code_edit.jsonl"
        prompts = write_dataset(dataset)
        summary["prompts"] = prompts
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for _ in range(args.repeats):
                for speculative in (None, args.speculative_config):
                    run = run_once(speculative, concurrency, dataset, prompts, args.port,
                                   Path(scratch))
                    run.update(concurrency=concurrency, config="spec" if speculative else "plain")
                    summary["runs"].append(run)
                    print(json.dumps(run), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serve_spec.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
