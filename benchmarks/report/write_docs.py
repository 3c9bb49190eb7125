"""Regenerate docs/benchmarks.md from benchmarks/results/*.json (never edit the page by hand)."""

from __future__ import annotations

import json

from benchmarks.paths import DOCS, NOTES, RESULTS
from benchmarks.report.plot import load_results


def core_section(r: dict) -> str:
    m, d, p, c, z, h = r["machine"], r["decode"], r["prefill"], r["cached_prefix"], r["concurrent_32_zero_hit"], r["hashing"]
    on, off = z["caching_on"], z["caching_off"]
    return f"""## Core engine (`make bench`, `python -m benchmarks.runners.run_core`)

Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), Python {m['python']},
torch {m['torch']}; commit {m['commit']}, {m['date']}. Model: bundled SmolLM2-135M-Instruct (Q4_1 GGUF
dequantized to fp32), fp32 KV cache, block size 16. Best of several runs.

| measurement | value |
|---|---|
| decode, one request (128 tokens) | {d['decode_tok_s_1_request']} tok/s ({d['decode_ms_per_token']} ms/token) |
| prefill, one 1,000-token prompt | {p['prefill_tok_s_1000']} tok/s (TTFT {p['ttft_cold_1000_s']} s) |
| 32 concurrent requests (256 prompt + 64 output tokens each), caching on | {on['output_tok_s']} output tok/s, {on['total_tok_s']} total tok/s, {on['wall_s']} s |
| same, caching off | {off['output_tok_s']} output tok/s, {off['wall_s']} s |
| caching on vs off at a 0% hit rate (goal: at most 2% slower; best of 3 runs each, order alternating) | {z['on_over_off_slowdown'] * 100:+.1f}% wall time |
| TTFT, 1,024-token prompt, cold | {c['ttft_cold_1024_s'] * 1000:.1f} ms |
| TTFT, same prompt length with the first 1,000 tokens cached | {c['ttft_cached_1000_of_1024_s'] * 1000:.1f} ms |
| cached / cold TTFT (goal: at most 10%) | {c['cached_over_cold'] * 100:.1f}% |
| block hashing, sha256 | {h['hash_ms_per_million_tokens_sha256']} ms per million tokens |
| block hashing, xxh3_128 | {h['hash_ms_per_million_tokens_xxh3_128']} ms per million tokens |
"""


def attention_section(r: dict) -> str:
    d, p, m = r["decode"], r["prefill"], r["machine"]
    dm, pm, dn, pn = d["ms"], p["ms"], d["min_ms"], p["min_ms"]
    return f"""## Paged attention vs dense SDPA (`python -m benchmarks.micro.bench_attention`)

{m['cpu']}; one layer call, fp32 compute, block size 16, shuffled block tables, {m['threads']} torch thread(s),
torch {m['torch']}, {m['date']}; median (min) ms of interleaved runs. Paged = `PagedAttentionBackend.forward`
(K/V write + attention; decode through the compiled CPU kernel that reads pages in place, or, in
the gather row, the torch fallback); dense = `F.scaled_dot_product_attention` alone over
contiguous K/V.

| decode: {d['shape']} | ms |
|---|---|
| dense SDPA, `enable_gqa=True` | {dm['dense_sdpa_gqa']} ({dn['dense_sdpa_gqa']}) |
| dense SDPA, GQA folded into query rows | {dm['dense_sdpa_folded']} ({dn['dense_sdpa_folded']}) |
| paged, fp32 KV | {dm['paged_fp32']} ({dn['paged_fp32']}) |
| paged, bf16 KV | {dm['paged_bf16_kv']} ({dn['paged_bf16_kv']}) |
| paged, fp8 KV | {dm['paged_fp8_kv']} ({dn['paged_fp8_kv']}) |
| paged, fp32 KV, gather + SDPA fallback (no C compiler) | {dm['paged_fp32_gather']} ({dn['paged_fp32_gather']}) |
| previous paged decode (token-major pages, fresh gather) | {dm['previous_token_major']} ({dn['previous_token_major']}) |
| **paged fp32 / best dense (goal: at most 1.3)** | **{d['paged_over_best_dense']}** ({d['paged_over_best_dense_min']}) |

| prefill: {p['shape']} | ms |
|---|---|
| dense SDPA, bottom-right causal mask | {pm['dense_sdpa_gqa']} ({pn['dense_sdpa_gqa']}) |
| paged, fp32 KV | {pm['paged_fp32']} ({pn['paged_fp32']}) |
| paged, fp8 KV | {pm['paged_fp8_kv']} ({pn['paged_fp8_kv']}) |
| **paged fp32 / dense (goal: at most 1.3)** | **{p['paged_over_dense']}** ({p['paged_over_dense_min']}) |
"""


def fp8_section(r: dict) -> str:
    rows = []
    for label, c in r["configs"].items():
        a = c["agreement_vs_float32"]
        rows.append(
            f"| {label} | {c['bytes_per_token']} | {a['positionwise'] * 100:.1f}% | "
            f"{a['before_first_divergence'] * 100:.1f}% | {a['identical_sequences']}/{r['num_prompts']} | "
            f"{c['teacher_forced_agreement_vs_float32'] * 100:.1f}% | {c['perplexity']} | "
            f"{c['perplexity_vs_float32'] * 100:+.2f}% |"
        )
    table = "\n".join(rows)
    return f"""## KV cache dtypes: quality (`python -m benchmarks.micro.bench_fp8`)

SmolLM2-135M fp32 weights; {r['num_prompts']} prompts x {r['max_tokens']} greedy tokens against the float32 KV
cache; perplexity of `benchmarks/data/perplexity_text.txt` ({next(iter(r['configs'].values()))['text_tokens']} tokens) fed in chunks of
{r['chunk']} tokens through the paged cache; {r['date']}. Goals for fp8: token agreement >= 90%, perplexity
within 2%. Agreement is read per position, teacher-forced (each KV dtype predicts every next token of
the float32 greedy continuation, the measure llama.cpp's `perplexity --kl-divergence` reports as
"Same top p"); free-running agreement turns the first flipped near-tie into a different text from
there on, so it is shown for reference: bf16 KV, 16x fp8's precision, does not reach 90% on it either.

| KV dtype | bytes/token | free-running agreement | before first divergence | identical sequences | teacher-forced agreement | perplexity | vs float32 |
|---|---|---|---|---|---|---|---|
{table}
"""


def sampling_head_section(r: dict) -> str:
    rows = [("bf16 mode: bf16 head against fp32 head", r["bf16_head_vs_fp32_head"]),
            ("fp32 mode against bf16 mode, fp32 head", r["fp32_mode_vs_bf16_mode_fp32_head"]),
            ("fp32 mode against bf16 mode, bf16 head", r["fp32_mode_vs_bf16_mode_bf16_head"])]
    table = "\n".join(f"| {label} | {d['tv_mean'] * 100:.2f}% | {d['tv_max'] * 100:.2f}% | "
                      f"{d['kl_mean']:.1e} |" for label, d in rows)
    return f"""## The bf16 mode's sampling head (`python -m benchmarks.micro.bench_sampling_head`)

In the bf16 mode, rows sampled at a temperature (no logprobs) draw from the head's bf16 product
with fp32 sums; greedy tokens and logprobs keep the fp32 head. Next-token distributions at
temperature 1 over {r['positions']} teacher-forced positions (the fp8 benchmark's prompts and the
fp32 mode's greedy continuations); {r['date']}, {r.get('cpu', 'CPU not recorded')}, torch
{r.get('torch', '?')}. Total variation is the share of draws that differ
under the best coupling of the two distributions.

| distributions | total variation, mean | max | KL, mean |
|---|---|---|---|
{table}
"""


def multimodal_section(r: dict) -> str:
    m, c, h = r["machine"], r["config"], r["hashing"]

    def row(key: str, label: str) -> str:
        x = r[key]
        return (f"| {label} | {x['wall_s_median']} s ({x['wall_s_best']} s) | {x['requests_per_s']} | "
                f"{x['prompt_tok_s']} | "
                f"{x['num_cached_tokens']} / {x['num_prompt_tokens']} | {x['encoder_images']} |")

    return f"""## Multimodal prefix caching (`python -m benchmarks.micro.bench_multimodal`)

Machine: {m['cpu']}, {m['torch_threads']} torch thread(s); commit {m['commit']}, {m['date']}.
Model: {c['model']}, {c['image_tokens']} image tokens per picture, block size {c['block_size']}.
{c['num_prompts']} prompts of one image and a question, {c['max_tokens']} output tokens each, all
submitted at once; {c['rounds']} rounds, on and off interleaved (order alternating), both caches
emptied before each run. Wall: median (best); requests/s and prompt tok/s from the best run.

| run | wall | requests/s | prompt tok/s | cached / prompt tokens | images encoded |
|---|---|---|---|---|---|
{row('hit_on', f"{c['hit_rate']:.0%} image hit rate, prefix caching on")}
{row('hit_off', f"{c['hit_rate']:.0%} image hit rate, prefix caching off")}
{row('zero_on', "0% hit rate, prefix caching on")}
{row('zero_off', "0% hit rate, prefix caching off")}

Throughput at a {c['hit_rate']:.0%} hit rate, caching on vs off (median of per-round ratios):
**{r['speedup_at_hit_rate']:.2f}x** (rounds: {', '.join(f"{x:.2f}" for x in r['speedup_at_hit_rate_rounds'])}).
Caching on vs off at a 0% hit rate (goal: at most 2% slower): **{r['overhead_at_zero_hit'] * 100:+.1f}%**
wall time (rounds: {', '.join(f"{x * 100:+.1f}%" for x in r['overhead_at_zero_hit_rounds'])}).
What caching adds per request when nothing hits, timed alone: block hashing with image extra
keys {h['block_hashing_us_per_request']} µs per request ({h['num_blocks_hashed']} blocks for
{h['num_requests']} requests); for scale, preprocessing plus the content hash (done in both modes)
{h['preprocess_and_content_hash_ms_per_image']} ms per image.
"""


def router_section(r: dict) -> str:
    m, w = r["machine"], r["workload"]
    rows = []
    for sc in r["scenarios"]:
        for policy in ("prefix", "round_robin"):
            for run in sc["runs"][policy]:
                rows.append(
                    f"| {sc['num_prefixes']} | {policy} | {run['cached_fraction'] * 100:.1f}% | "
                    f"{run['computed_prompt_tokens']:,} | {run['output_tok_s']} | {run['wall_s']} | "
                    f"{'/'.join(map(str, run['requests_per_replica']))} |"
                )
    ratios = ", ".join(
        f"{sc['num_prefixes']} prefix(es): {sc['prefix_over_round_robin_throughput']}x"
        for sc in r["scenarios"]
    )
    return f"""## Scale-out: 2 replicas behind `kvmemo router` (`python -m benchmarks.micro.bench_router`)

Machine: {m['cpu']}, {m['cores']} cores, {m['threads_per_replica']} torch thread(s) per replica,
Python {m['python']}; commit {m['commit']}, {m['date']}. Workload: {w['num_questions']} requests,
each a ~{w['system_tokens']}-token system prompt (shared; split over N different ones) + a distinct
~32-token question, {w['output_tokens']} greedy output tokens, {w['concurrency']} in flight, 2 replicas
(`kvmemo serve`, bundled SmolLM2, fp32). Policies alternate on the same replicas (caches reset
before each run). Command: `{r['command']}`.

| system prompts | policy | cached prompt tokens | prompt tokens computed | output tok/s | wall s | requests per replica |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Throughput, prefix-aware over round robin (best runs): {ratios}.
"""


def beam_search_section(r: dict) -> str:
    m, s = r["machine"], r["setup"]
    return f"""## Beam search (`python -m benchmarks.micro.bench_beam_search`)

Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), torch {m['torch']};
commit {m['commit']}, {m['date']}. {s['num_prompts']} prompts ({s['prompt_tokens']} tokens, each
starting with the same {s.get('context_tokens', 0)} filler tokens),
beam_width {s['beam_width']}, max_tokens {s['max_tokens']}, fp32, block size {s['block_size']};
runs interleaved in one process, best of {s['reps']}.

| measurement | value |
|---|---|
| kvmemo `LLM.beam_search`, all prompts batched | {r['kvmemo_beam_wall_s']} s ({r['num_steps']} steps) |
| HF `generate(num_beams={s['beam_width']})`, one prompt at a time | {r['hf_beam_wall_s']} s |
| HF / kvmemo wall time | {r['hf_over_kvmemo']}x |
| kvmemo greedy `generate` on the same prompts | {r['kvmemo_greedy_wall_s']} s (beam / greedy {r['beam_over_greedy']}x) |
| peak KV blocks in use (beams share blocks copy-on-write) | {r['peak_blocks_used']} |
| blocks if every beam held its own copy of prompt + output (no forks, no prefix cache; computed) | {r['blocks_without_sharing']} |
| returned beams equal HF's | {r['beams_equal_hf']} |
"""


def gguf_section(model: str, title: str) -> str:
    """A GGUF model beside llama.cpp (micro/bench_gguf.py), each engine and mode a column."""
    runs = {name: json.loads((RESULTS / f"{model}-{name}.json").read_text())
            for name in ("kvmemo", "kvmemo-native", "kvmemo-bfloat16", "llama.cpp")
            if (RESULTS / f"{model}-{name}.json").is_file()}
    if "kvmemo" not in runs:
        return ""
    names = list(runs)
    rows = [
        ("decode, one request, 18-token context (tok/s)", "decode_tok_s_ctx18", "{:.1f}"),
        ("decode, one request, 1,024-token context (tok/s)", "decode_tok_s_ctx1024", "{:.1f}"),
        ("prefill, 1,024 tokens (tok/s)", "prefill_tok_s_1024", "{:.0f}"),
        ("W1, wall (s)", "w1_s", "{:.2f}"),
        ("start (load to ready, s)", "startup_s", "{:.2f}"),
        ("peak RSS of the whole run (MiB)", "peak_rss_bytes", "{:.0f}"),
    ]
    lines = [
        f"## {title} beside llama.cpp (`python -m benchmarks.micro.bench_gguf --model {model}`)\n",
        f"Same GGUF and token ids, one sitting; machine {runs['kvmemo']['cpu']}. kvmemo: "
        "fp32 compute, weights dequantized at load, unless marked (native: GGUF bits read in "
        "place); llama.cpp runs the GGUF's own types with one thread per core. Median of 3.\n",
        "| measurement | " + " | ".join(
            n if n.startswith("kvmemo") else f"{n} ({runs[n]['version']})" for n in names
        ) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, key, fmt in rows:
        scale = 2**20 if key.endswith("_bytes") else 1
        cells = [fmt.format(runs[n][key] / scale) if key in runs[n] else "-" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    k = runs["kvmemo"]
    if "kv_bytes_4096" in k and model.startswith("gemma3"):
        lines += [
            "",
            f"KV of one 4,096-token conversation in kvmemo (fp32): "
            f"{k['kv_bytes_4096'] / 2**20:.1f} MiB (3 full layers x 4,096 tokens + 15 sliding "
            f"layers x their 512-token window), against {k['kv_bytes_4096_all_full'] / 2**20:.1f} "
            "MiB if every layer held the whole context.\n",
        ]
    return "\n".join(lines)


def native_quality_section(r: dict) -> str:
    """weights="native" against the exact fp32 mode, a row per weight format."""
    lines = [
        "## Native GGUF weights against the exact fp32 mode "
        "(`python -m benchmarks.micro.bench_native_quality --gemma`)\n",
        f"{r['date']}, {r['cpu']}. Teacher-forced: the fp8 benchmark's {r['prompts']} prompts, "
        f"{r['max_tokens']} greedy fp32 tokens each as reference, native predicting every next "
        "token one step at a time through the paged cache (the decode path: int8 activations, a "
        f"scale per 4 values). Perplexity: benchmarks/data/perplexity_text.txt in chunks of "
        f"{r['chunk']} tokens, both modes. Requantized rows: the bundled model's layer weights "
        "re-quantized by gguf-py, both modes reading that file.\n",
        "| model | weight formats | teacher-forced agreement | perplexity fp32 | native | change |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['model']} | {row['formats']} | {100 * row['teacher_forced_agreement']:.2f}% "
            f"| {row['perplexity_fp32']:.3f} | {row['perplexity_native']:.3f} "
            f"| {100 * row['perplexity_change']:+.2f}% |")
    return "\n".join(lines) + "\n"


def footprint_section(r: dict) -> str:
    """One chat turn in a fresh process: start to first token and peak RSS, beside llama.cpp."""
    lines = [
        "## Start-up and memory of one turn (`python -m benchmarks.micro.bench_footprint`)\n",
        f"{r['date']}, {r['cpu']}, {r['model']}: a fresh process loads the model with a "
        f"{r['context']:,}-token context and generates {r['tokens']} tokens; median of "
        f"{r['repeats']}, the engines alternating.\n",
        "| engine | process start to first token (s) | peak RSS (MiB) |",
        "|---|---|---|",
    ]
    for engine, row in r["engines"].items():
        lines.append(f"| {engine} | {row['start_to_first_token_s']:.2f} | "
                     f"{row['peak_rss_bytes'] / 2**20:.0f} |")
    return "\n".join(lines) + "\n"


def floor_section(r: dict) -> str:
    """W1's wall against its matmul floors (FLOPs over the best GEMM rate measured)."""
    lines = [
        "## W1 against its matmul floor (`python -m benchmarks.micro.bench_floor`)\n",
        f"{r['date']}, {r['cpu']}, torch {r['torch']}, {r['threads']} threads. Best GEMM rate: "
        "what the engine's own bound kernels reach in the same process (layer 0's projections "
        "and the head at 32 and 1,024 rows). Linear floor: W1's linear-layer FLOPs (2 x weights "
        "per computed row, the head per sampled row) at that rate; the wall pays for attention "
        "on top. Step floor: all of the steps' FLOPs, linear and attention (q.k and p.v of each "
        "query over its causal keys), at the same rate. Median wall of the runs after a "
        "warm-up.\n",
        "| dtype | wall s | best GEMM GFLOP/s | linear GFLOP | attention GFLOP | linear floor s "
        "| wall / linear floor | step floor s | wall / step floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, row in r["dtypes"].items():
        step = (f"{row['step_floor_s']:.2f} | {row['wall_over_step_floor']:.2f}x"
                if "step_floor_s" in row else "- | -")
        lines.append(f"| {dtype} | {row['wall_s']:.2f} | {row['best_gemm_gflops']:.0f} | "
                     f"{row['linear_gflop']:.0f} | {row['attention_gflop']:.0f} | "
                     f"{row['floor_s']:.2f} | {row['wall_over_floor']:.2f}x | {step} |")
    return "\n".join(lines) + "\n"


def peers_section() -> str:
    """Side-by-side table (runners.run_suite results) and the charts report.plot drew."""
    lines = ["## Side by side (`python -m benchmarks.runners.run_suite`, same token ids for every "
             "engine)\n"]
    for mode in ("offline", "online"):
        table = load_results(mode)
        if not table:
            continue
        lines += [f"### {mode}\n", "| workload | engine | wall s | output tok/s | TTFT p50 s | TTFT p90 s | "
                  "prompt tokens | cached | start-up s | version | machine, date |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for workload, engines in table.items():
            for engine, r in sorted(engines.items()):
                cached = "n/a" if r["cached_prompt_tokens"] is None else f"{r['cached_prompt_tokens']:,}"
                lines.append(
                    f"| {workload} | {engine} | {r['wall_s']:.2f} | {r['output_tok_s']:.1f} | "
                    f"{r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | {r['prompt_tokens']:,} | {cached} | "
                    f"{r['startup_s']:.1f} | {r['engine_version']} | {r['machine']['cpu']}, "
                    f"{r['machine']['date'][:10]} |")
        lines.append("")
    lines.append("Compare rows only within one machine and date (one sitting); every machine has "
                 "2 cores.\n")
    for image in ("bench_throughput.png", "bench_ttft.png"):
        if (DOCS / "img" / image).is_file():
            lines.append(f"![{image}](img/{image})\n")
    return "\n".join(lines) if len(lines) > 1 else ""


def rag_blend_section(r: dict) -> str:
    full = r["runs"]["no caching"]
    rows = []
    for label, run in r["runs"].items():
        tf = run.get("teacher_forced_agreement")
        rows.append(
            f"| {label} | {run['ttft_median_s']:.3f} | "
            f"{100 * run['ttft_median_s'] / full['ttft_median_s']:.0f}% | "
            f"{run['needle_accuracy'] * 100:.0f}% | "
            f"{'-' if tf is None else f'{tf * 100:.1f}%'} | "
            f"{run.get('blended_tokens_mean', 0):.0f} | "
            f"{run.get('recomputed_tokens_mean', run['prompt_tokens_mean'] - run['cached_tokens_mean']):.0f} |"
        )
    table = "\n".join(rows)
    tokens = r["chunk_tokens"]
    return f"""## RAG prompts: chunk KV blending (`python -m benchmarks.micro.bench_rag_blend`)

{r['cpu']}, {r['dtype']}, SmolLM2-135M; {r['queries']} queries, each [system, 8 chunks of
{min(tokens)}-{max(tokens)} tokens drawn from 64 in a per-query order, question]
(~{r['runs']['no caching']['prompt_tokens_mean']:.0f} tokens); one request at a time, 32 greedy
tokens. TTFT as a share of full prefill (goal at ratio 0.15: at most 20%); teacher-forced
agreement with the full prefill's 32 answer tokens (goal: 95%); needle accuracy (goal: within 3
points of full prefill). Default check layer {r['default_check_layer']}. Analysis and what was
tried: [blending.md](blending.md).

| run | TTFT median (s) | of full prefill | needles found | teacher-forced agreement | reused tokens | computed tokens |
|---|---|---|---|---|---|---|
{table}

![TTFT against quality](img/rag_blend.png)
"""


# (results file, renderer), in page order; a section appears once its results exist.
SECTIONS = (
    ("core.json", core_section),
    ("attention.json", attention_section),
    ("fp8_kv.json", fp8_section),
    ("sampling_head.json", sampling_head_section),
    ("beam_search.json", beam_search_section),
    ("multimodal.json", multimodal_section),
    ("router.json", router_section),
    ("rag_blend.json", rag_blend_section),
    ("native_quality.json", native_quality_section),
    ("footprint.json", footprint_section),
    ("w1_floor.json", floor_section),
)


def main() -> None:
    parts = ["# kvmemo benchmarks\n\n_Generated by `python -m benchmarks.report.write_docs` from "
             "`benchmarks/results/`; do not edit by hand (analysis lives in `benchmarks/notes.md`)._\n"]
    for name, section in SECTIONS:
        if (RESULTS / name).is_file():
            parts.append(section(json.loads((RESULTS / name).read_text())))
    parts.append(gguf_section("smollm2", "SmolLM2-135M (Q4_1)"))
    parts.append(gguf_section("gemma3-270m", "Gemma 3 270M (Q4_K_M)"))
    parts.append(peers_section())  # benchmarks/results/peers/*.json, one file per engine run
    if NOTES.is_file():
        parts.append(NOTES.read_text())
    DOCS.mkdir(exist_ok=True)
    (DOCS / "benchmarks.md").write_text("\n".join(parts))
    print(f"wrote {DOCS / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
