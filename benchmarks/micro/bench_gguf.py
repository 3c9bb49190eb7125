"""A GGUF model on kvmemo beside llama.cpp on the same file, one sitting: the bundled SmolLM2
(Q4_1) or Gemma 3 270M (Q4_K_M).

    python -m benchmarks.micro.bench_gguf --model gemma3-270m --engine kvmemo  # writes prompts
    python -m benchmarks.micro.bench_gguf --model gemma3-270m --engine kvmemo --weights native
    benchmarks/peers/.venv-llamacpp/bin/python -m benchmarks.micro.bench_gguf \
        --model gemma3-270m --engine llama.cpp
    # some figures only (--only), kvmemo with another KV dtype (--kv-cache-dtype):
    python -m benchmarks.micro.bench_gguf --model smollm2 --engine kvmemo --weights native \
        --only decode_tok_s_ctx18,decode_tok_s_ctx1024 --kv-cache-dtype bfloat16

Figures: decode of one request at 18 and 1,024 tokens of context (greedy, 128 tokens, EOS
ignored), prefill of 1,024 tokens (no cache), W1 built with Gemma's tokenizer (32 x [~1,024
shared + ~32 own] tokens, 32 out; kvmemo batches them, llama.cpp runs them one by one with its
prompt cache), and the KV bytes a 4,096-token conversation holds, and peak RSS. kvmemo runs first and writes
the token ids (benchmarks/results/<model>-prompts.json), so llama.cpp gets the very same ids.
Imports nothing outside the standard library at module level: the llama.cpp venv has no torch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time

from benchmarks.machine_info import cpu_label, forced_isa
from benchmarks.paths import RESULTS

MODELS = ("smollm2", "gemma3-270m")
DECODE_TOKENS = 128
OUTPUT_TOKENS = 32  # W1's
REPEATS = 3


def _prompts_file(model: str):
    return RESULTS / f"{model}-prompts.json"


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


FIGURES = ("decode_tok_s_ctx18", "decode_tok_s_ctx1024", "prefill_tok_s_1024", "w1_s")


def _measure(figures: dict, only: tuple[str, ...]) -> dict:
    """The figures asked for (all by default), each measured by calling its function."""
    return {name: measure() for name, measure in figures.items() if name in only}


def _kvmemo(model: str, dtype: str, weights: str, kv_cache_dtype: str,
            only: tuple[str, ...]) -> dict:
    from kvmemo import LLM, SamplingParams
    from kvmemo.model.loading.loader import bundled_model_path, packaged_gemma3_path
    from kvmemo.model.models.registry import default_chat_template

    path = packaged_gemma3_path() if model == "gemma3-270m" else bundled_model_path()
    start = time.perf_counter()
    llm = LLM(path, dtype=dtype, weights=weights, kv_cache_dtype=kv_cache_dtype)
    startup_s = time.perf_counter() - start
    tok = llm.engine.tokenizer
    words = "river stone light market garden window paper silver engine forest music".split()
    text = " ".join(words[(i * 7) % len(words)] for i in range(3000))
    long_ids = tok(text).input_ids[:1024]
    short_ids = tok("The history of the river stone market began when").input_ids[:18]
    if model == "gemma3-270m":
        tok.chat_template = default_chat_template("gemma3")  # the GGUF ships none; kvmemo's
        w1_prompts = _gemma_w1(tok)
    else:
        from benchmarks.workloads import build_w1

        w1_prompts = [r["prompt_token_ids"] for r in build_w1(tok).requests]
    _prompts_file(model).write_text(json.dumps({
        "model": path, "short": short_ids, "long": long_ids, "w1": w1_prompts,
        "w1_max_tokens": OUTPUT_TOKENS,
    }))
    greedy = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)

    def decode(ids: list[int]) -> float:
        rates = []
        for _ in range(REPEATS):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            (out,) = llm.generate([ids], greedy, use_tqdm=False)
            wall = time.perf_counter() - start
            rates.append((DECODE_TOKENS - 1) / (wall - out.metrics.ttft_s))
        return statistics.median(rates)

    def prefill() -> float:
        times = []
        for _ in range(REPEATS):
            llm.reset_prefix_cache()
            (out,) = llm.generate([long_ids], SamplingParams(max_tokens=1), use_tqdm=False)
            times.append(out.metrics.ttft_s)
        return len(long_ids) / statistics.median(times)

    def w1_run() -> float:
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
        times = []
        for _ in range(REPEATS):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(w1_prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    llm.generate([short_ids], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    result = _measure({
        "decode_tok_s_ctx18": lambda: decode(short_ids),
        "decode_tok_s_ctx1024": lambda: decode(long_ids),
        "prefill_tok_s_1024": prefill,
        "w1_s": w1_run,
    }, only)
    # KV of one 4,096-token conversation: what the pool holds for it (a sliding layer keeps its
    # window), against what 18 full-attention layers would hold.
    layout = llm.engine.layout
    block_bytes = layout.block_size * layout.bytes_per_token
    num_blocks = sum(
        -(-4096 // layout.block_size) if g.sliding_window is None
        else -(-(g.sliding_window - 1) // layout.block_size) + 1
        for g in layout.groups
    )
    per_layer_token = layout.bytes_per_token // layout.layers_per_block
    result["kv_bytes_4096"] = num_blocks * block_bytes
    result["kv_bytes_4096_all_full"] = 4096 * per_layer_token * layout.num_layers
    result["version"] = "kvmemo (this checkout)"
    result["options"] = {"dtype": dtype, "weights": weights, "kv_cache_dtype": kv_cache_dtype}
    result["startup_s"] = startup_s
    result["weights_bytes"] = llm.memory_stats().weights_bytes
    result["peak_rss_bytes"] = _peak_rss_bytes()
    return result


def _gemma_w1(tok, num_requests: int = 32, system_tokens: int = 1024) -> list[list[int]]:
    """W1's shape in Gemma's turn format: Gemma has no system turn, so the ~1,024-token system
    text opens the first user turn, and each request adds its own ~32-token question there
    (workloads.build_w1 renders a system-only conversation, which Gemma's template drops)."""
    import random

    from benchmarks.workloads import DEFAULT_SEED, _chat_ids, _exact_tokens, _words

    rng = random.Random(f"W1-gemma3-{DEFAULT_SEED}")
    system = "You are a helpful assistant. Reference notes: " + _words(rng, system_tokens)
    prompts = []
    for i in range(num_requests):
        question = tok.decode(_exact_tokens(tok, rng, 32))
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"{i}: {question}"}]
        prompts.append(_chat_ids(tok, messages, True))
    shared = min(sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(prompts[0], q)))
                 for q in prompts[1:])
    assert shared > 900, f"the prompts share only {shared} tokens"
    return prompts


def _llamacpp(model: str, threads: int, only: tuple[str, ...]) -> dict:
    import llama_cpp

    data = json.loads(_prompts_file(model).read_text())
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=data["model"], n_ctx=8192, n_threads=threads, n_batch=512,
                          verbose=False)
    startup_s = time.perf_counter() - start
    eos = llm.token_eos()

    def no_eos(input_ids, scores):
        scores[eos] = -float("inf")
        return scores

    processors = llama_cpp.LogitsProcessorList([no_eos])

    def generate(ids: list[int], n: int) -> tuple[float, float]:
        """(seconds to the first token, seconds for all n)."""
        llm.reset()
        start = time.perf_counter()
        first = None
        for count, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1,
                                               logits_processor=processors), 1):
            if first is None:
                first = time.perf_counter() - start
            if count == n:
                break
        return first or 0.0, time.perf_counter() - start

    def decode(ids: list[int]) -> float:
        rates = []
        for _ in range(REPEATS):
            ttft, wall = generate(ids, DECODE_TOKENS)
            rates.append((DECODE_TOKENS - 1) / (wall - ttft))
        return statistics.median(rates)

    def prefill() -> float:
        return len(data["long"]) / statistics.median(
            generate(data["long"], 1)[0] for _ in range(REPEATS)
        )

    def w1_run() -> float:
        times = []
        for _ in range(REPEATS):
            llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=2 << 30))
            start = time.perf_counter()
            for ids in data["w1"]:
                try:
                    llm.load_state(llm.cache[ids])
                except KeyError:
                    pass
                for count, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1,
                                                       logits_processor=processors), 1):
                    if count == data["w1_max_tokens"]:
                        break
                llm.cache[llm._input_ids.tolist()] = llm.save_state()
            times.append(time.perf_counter() - start)
            llm.set_cache(None)
        return statistics.median(times)

    generate(data["short"], 4)  # warm-up
    return {
        **_measure({
            "decode_tok_s_ctx18": lambda: decode(data["short"]),
            "decode_tok_s_ctx1024": lambda: decode(data["long"]),
            "prefill_tok_s_1024": prefill,
            "w1_s": w1_run,
        }, only),
        "version": f"llama-cpp-python {llama_cpp.__version__}",
        "options": {"n_threads": threads, "n_batch": 512, "n_ctx": 8192},
        "startup_s": startup_s,
        "peak_rss_bytes": _peak_rss_bytes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS, default="gemma3-270m")
    parser.add_argument("--engine", choices=["kvmemo", "llama.cpp"], required=True)
    parser.add_argument("--dtype", default="float32", help="kvmemo compute dtype")
    parser.add_argument("--weights", default="dense", choices=["dense", "native"],
                        help="kvmemo's weights option")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="llama.cpp threads (default: one per core, its best on 2 cores)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="kvmemo's kv_cache_dtype (auto: the engine's default)")
    parser.add_argument("--only", default=",".join(FIGURES),
                        help=f"comma-separated figures to measure, of {', '.join(FIGURES)}")
    args = parser.parse_args()
    only = tuple(args.only.split(","))
    unknown = sorted(set(only) - set(FIGURES))
    if unknown:
        parser.error(f"--only: unknown figures {unknown}; allowed: {', '.join(FIGURES)}")
    if args.engine == "kvmemo":
        result = _kvmemo(args.model, args.dtype, args.weights, args.kv_cache_dtype, only)
    else:
        result = _llamacpp(args.model, args.threads, only)
    result.update(engine=args.engine, model=args.model, cpu=cpu_label(), machine=platform.machine())
    suffix = ""
    if args.engine == "kvmemo":
        suffix = ("" if args.weights == "dense" else f"-{args.weights}") + (
            "" if args.dtype == "float32" else f"-{args.dtype}"
        ) + ("" if args.kv_cache_dtype == "auto" else f"-kv-{args.kv_cache_dtype}")
    forced = forced_isa()  # a forced-ISA run keeps its own file beside the native one
    suffix += f"-{forced}" if forced else ""
    out = RESULTS / f"{args.model}-{args.engine}{suffix}.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
