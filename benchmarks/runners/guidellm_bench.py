"""GuideLLM, unmodified, against `kvmemo serve` (and `vllm serve` beside it, one at a time):
chat completions, streamed, with its synthetic text.

    bash benchmarks/peers/setup_guidellm.sh      # once: guidellm 0.8.1 in its own venv
    python -m benchmarks.runners.guidellm_bench --engines kvmemo,vllm

Workload: guidellm's `synthetic_text` data, 256 prompt tokens and 32 output tokens per request
(it sends `ignore_eos`), 64 requests at a concurrency of 8 (`--profile kind=concurrent,
streams=8`). guidellm asks for `stream_options.continuous_usage_stats`, which kvmemo serves as
vLLM does. Both servers get the same weights and dtype (the vLLM side as in serve_bench).
Writes benchmarks/results/guidellm.json (a summary) beside guidellm's own report per engine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from benchmarks.machine_info import cpu_label
from benchmarks.paths import PEERS, RESULTS, ROOT
from benchmarks.runners.run_suite import engine_env
from benchmarks.runners.serve_bench import server_command
from benchmarks.server_process import running_server

GUIDELLM = PEERS / ".venv-guidellm" / "bin" / "guidellm"
OUT = RESULTS / "guidellm"


def run(engine: str, dtype: str, port: int, tokenizer_dir: Path) -> dict:
    command, name = server_command(engine, dtype, port)
    env = engine_env(engine) if engine == "vllm" else None
    report = OUT / f"{engine}-{dtype}.json"
    with running_server(command, port, env, timeout_s=600) as url:
        subprocess.run(
            [str(GUIDELLM), "run",
             "--backend", f"kind=openai_http,target={url},model={name}",
             "--profile", "kind=concurrent,streams=8",
             "--constraint", "kind=max_requests,count=64",
             "--data", "kind=synthetic_text,prompt_tokens=256,output_tokens=32",
             "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
             "--output", f"kind=json,path={report}", "--disable-progress"],
            cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
        )
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    metrics = benchmark["metrics"]

    def mean(name: str) -> float:
        return round(metrics[name]["successful"]["mean"], 2)

    return {
        "requests": metrics["request_totals"],
        "duration_s": round(benchmark["duration"], 2),
        "output_tokens_per_s": round(
            metrics["output_token_count"]["successful"]["total_sum"] / benchmark["duration"], 1
        ),
        "mean_ttft_ms": mean("time_to_first_token_ms"),
        "mean_itl_ms": mean("inter_token_latency_ms"),
        "mean_request_latency_s": mean("request_latency"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="kvmemo,vllm")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args()
    if not GUIDELLM.exists():
        raise SystemExit(f"{GUIDELLM} is missing: run bash benchmarks/peers/setup_guidellm.sh")
    from kvmemo.model.loading.loader import bundled_model_path
    from kvmemo.model.loading.tokenizer import load_gguf_tokenizer

    OUT.mkdir(parents=True, exist_ok=True)
    gguf = Path(bundled_model_path())
    summary: dict = {"machine": cpu_label(), "dtype": args.dtype,
                     "workload": "guidellm synthetic_text 256 in / 32 out, 64 requests, "
                                 "concurrency 8, chat, streamed"}
    with tempfile.TemporaryDirectory(prefix="kvmemo-guidellm-") as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"  # guidellm sizes its synthetic prompts with it
        load_gguf_tokenizer(gguf, "guidellm-" + gguf.name).save_pretrained(tokenizer_dir)
        for engine in args.engines.split(","):
            summary[engine] = run(engine, args.dtype, args.port, tokenizer_dir)
            print(engine, json.dumps(summary[engine]), flush=True)
    (RESULTS / "guidellm.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
