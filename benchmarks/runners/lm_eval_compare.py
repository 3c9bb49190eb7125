"""lm-evaluation-harness, unmodified, against `kvmemo serve`, checked against its own `hf`
backend on the same GGUF (fp32): the same accuracy, and per-choice loglikelihoods within 1e-3.

    bash benchmarks/peers/setup_lmeval.sh          # once: lm-eval 0.4.13 in its own venv
    python -m benchmarks.runners.lm_eval_compare

The task is benchmarks/lm_eval_task (24 multiple-choice questions in a local JSON Lines file;
no hub). lm-eval's local-completions client sends each (question, choice) as token ids with
`echo: true, logprobs: 1, max_tokens: 1` and reads the prompt tokens' logprobs back. Writes
benchmarks/results/lm_eval.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine_info import cpu_label
from benchmarks.paths import BENCHMARKS, PEERS, RESULTS
from benchmarks.server_process import running_server

LM_EVAL = PEERS / ".venv-lmeval" / "bin" / "lm_eval"
TASK_DIR = BENCHMARKS / "lm_eval_task"
TOLERANCE = 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _task_dir(work: Path) -> Path:
    """The task YAML with the data file's absolute path filled in."""
    task = work / "task"
    task.mkdir()
    text = (TASK_DIR / "kvmemo_mc.yaml.in").read_text()
    data = TASK_DIR / "kvmemo_mc.jsonl"
    (task / "kvmemo_mc.yaml").write_text(text.replace("@DATA@", str(data)))
    return task


def _run_lm_eval(model: str, model_args: str, task: Path, out: Path) -> tuple[dict, list, float]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    subprocess.run(
        [str(LM_EVAL), "--model", model, "--model_args", model_args, "--tasks", "kvmemo_mc",
         "--include_path", str(task), "--batch_size", "1", "--device", "cpu",
         "--output_path", str(out), "--log_samples"],
        check=True, env=env,
    )
    elapsed = time.perf_counter() - start
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["kvmemo_mc"]
    samples = [json.loads(line) for line in next(out.rglob("samples_kvmemo_mc_*.jsonl")).open()]
    samples.sort(key=lambda s: s["doc_id"])
    return results, samples, elapsed


def _loglikelihoods(samples: list[dict]) -> list[list[float]]:
    """Per doc, per choice: the continuation's loglikelihood."""
    return [[float(resp[0][0]) for resp in s["resps"]] for s in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: the bundled SmolLM2)")
    args = parser.parse_args()
    if not LM_EVAL.exists():
        sys.exit(f"{LM_EVAL} is missing: run bash benchmarks/peers/setup_lmeval.sh first")
    from kvmemo.model.loading.loader import bundled_model_path
    from kvmemo.model.loading.tokenizer import load_gguf_tokenizer

    gguf = Path(args.model or bundled_model_path()).resolve()
    with tempfile.TemporaryDirectory(prefix="kvmemo-lmeval-") as tmp:
        work = Path(tmp)
        task = _task_dir(work)
        tokenizer_dir = work / "tokenizer"  # local-completions tokenizes with it
        load_gguf_tokenizer(gguf, "lm-eval-" + gguf.name).save_pretrained(tokenizer_dir)

        port = _free_port()
        command = [sys.executable, "-m", "kvmemo.cli", "serve", "--model", str(gguf),
                   "--port", str(port), "--served-model-name", "smollm2"]
        with running_server(command, port) as url:
            served, served_samples, served_s = _run_lm_eval(
                "local-completions",
                f"model=smollm2,base_url={url}/v1/completions,tokenizer={tokenizer_dir},"
                "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,"
                "max_retries=1",
                task, work / "served",
            )
        reference, hf_samples, hf_s = _run_lm_eval(
            "hf", f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32",
            task, work / "hf",
        )
    ours, theirs = _loglikelihoods(served_samples), _loglikelihoods(hf_samples)
    diffs = [abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    summary = {
        "machine": cpu_label(),
        "task": "kvmemo_mc (24 questions x 4 choices)",
        "kvmemo_serve": {"acc": served["acc,none"], "acc_norm": served["acc_norm,none"],
                         "wall_s": round(served_s, 1)},
        "hf_fp32": {"acc": reference["acc,none"], "acc_norm": reference["acc_norm,none"],
                    "wall_s": round(hf_s, 1)},
        "loglikelihoods": len(diffs),
        "max_abs_diff": max(diffs),
        "all_within_1e-3": max(diffs) <= TOLERANCE,
        "same_accuracy": (served["acc,none"], served["acc_norm,none"])
        == (reference["acc,none"], reference["acc_norm,none"]),
    }
    print(json.dumps(summary, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lm_eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not (summary["all_within_1e-3"] and summary["same_accuracy"]):
        sys.exit("kvmemo serve and lm-eval's hf backend disagree (see above)")


if __name__ == "__main__":
    main()
