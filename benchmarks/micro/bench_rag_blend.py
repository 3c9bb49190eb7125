"""RAG prompts with chunk KV blending: TTFT against quality, no caching vs prefix caching vs blend.

    python -m benchmarks.micro.bench_rag_blend [--queries 16] [--dtype float32] [--threads 2]

Corpus: Python's own help topics (pydoc_data.topics, on every machine with Python), cut at
paragraph borders into 64 chunks of 256-512 tokens. Every fourth chunk gets one planted needle,
"The archive code of the <Name> collection is <4 digits>.", at a paragraph border near its
middle (with a needle in every chunk, the 135M model mixes up the 8 codes of a prompt even with
full prefill). Each query asks for one needle's code; its prompt is [system context, 8 chunks,
question]: the needle's chunk and 7 needle-free chunks drawn from the pool, in an order drawn per
query (seeded), so chunks recur across queries at different positions.

Runs, one request at a time, greedy, 32 new tokens (ignore_eos), every engine's KV pool touched
first (touch_pool):
- no caching (enable_prefix_caching=False): the full-prefill reference;
- prefix caching alone: hits only the system context's blocks;
- blend at recompute ratios 0, 0.15 and 0.3, with every chunk cached first (warm);
- blend with nothing cached (0% reuse): the cold path, an exact prefill;
- a check-layer sweep at ratio 0.15.
Quality against the full prefill: teacher-forced agreement on the 32 answer tokens (the
reference answer appended to the question, every answer position's argmax compared; the answer
rows are recomputed rows of the blend, so they attend over the blended KV exactly as decoding
would), and needle accuracy (the code appears in the answer). Writes
benchmarks/results/rag_blend.json and docs/img/rag_blend.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import pydoc_data.topics
import random
import statistics
import time
from typing import Any

from benchmarks.machine_info import cpu_label
from benchmarks.paths import DOCS, RESULTS
from kvmemo import LLM, SamplingParams
from kvmemo.engine.blend_driver import BlendSettings

NUM_CHUNKS = 64
CHUNKS_PER_PROMPT = 8
NEEDLE_EVERY = 4  # chunks 0, 4, 8, ... hold a needle
ANSWER_TOKENS = 32
CONTEXT = (
    "<|im_start|>system\nYou are a helpful assistant. Read the documents below and answer the "
    "question with the exact value from them.\n"
)
NAMES = [
    "Amber", "Birch", "Cobalt", "Delta", "Ember", "Falcon", "Garnet", "Harbor", "Iris", "Juniper",
    "Kestrel", "Lumen", "Maple", "Nimbus", "Onyx", "Pioneer", "Quartz", "Raven", "Sable", "Tundra",
    "Umber", "Vesper", "Willow", "Xenon", "Yarrow", "Zephyr", "Aurora", "Basalt", "Cinder",
    "Dune", "Elm", "Fjord", "Glacier", "Heron", "Indigo", "Jasper", "Kelp", "Lotus", "Meadow",
    "Nectar", "Opal", "Prairie", "Quill", "Reef", "Saffron", "Thistle", "Unity", "Violet",
    "Wren", "Yukon", "Zinnia", "Acorn", "Bramble", "Canyon", "Dahlia", "Egret", "Fennel",
    "Granite", "Hazel", "Ivory", "Jade", "Kite", "Larch", "Mistral",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
OUT = RESULTS / "rag_blend.json"
CHART = DOCS / "img" / "rag_blend.png"


@dataclasses.dataclass(frozen=True)
class Chunk:
    text: str
    name: str
    code: str


@dataclasses.dataclass(frozen=True)
class Query:
    order: list[int]  # chunk indices, in prompt order
    target: int

    def segments(self, chunks: list[Chunk]) -> list[str]:
        name = chunks[self.target].name
        question = (
            f"<|im_end|>\n<|im_start|>user\nWhat is the archive code of the {name} collection? "
            "Answer with the number.<|im_end|>\n<|im_start|>assistant\n"
        )
        return [CONTEXT, *(chunks[i].text for i in self.order), question]


def build_corpus(count_tokens) -> list[Chunk]:
    """64 chunks of 256-512 tokens from the help topics, each with its needle."""
    rng = random.Random(7)
    paragraphs = [
        p.strip()
        for key in sorted(pydoc_data.topics.topics)
        for p in pydoc_data.topics.topics[key].split("\n\n")
        if len(p.strip()) > 40
    ]
    chunks: list[Chunk] = []
    current: list[str] = []
    for paragraph in paragraphs:
        if count_tokens("\n\n".join(current + [paragraph])) > 440 and current:
            if count_tokens("\n\n".join(current)) >= 256:
                name, code = NAMES[len(chunks)], str(rng.randint(1000, 9999))
                middle = len(current) // 2
                needle = f"The archive code of the {name} collection is {code}."
                planted = current[:middle] + [needle] + current[middle:]
                has_needle = len(chunks) % NEEDLE_EVERY == 0
                text = "\n\n".join(planted if has_needle else current) + "\n\n"
                chunks.append(Chunk(text, name, code if has_needle else ""))
                if len(chunks) == NUM_CHUNKS:
                    return chunks
            current = []
        current.append(paragraph)
    raise RuntimeError(f"the help topics gave only {len(chunks)} chunks")


def build_queries(count: int) -> list[Query]:
    rng = random.Random(11)
    needles = [i for i in range(NUM_CHUNKS) if i % NEEDLE_EVERY == 0]
    plain = [i for i in range(NUM_CHUNKS) if i % NEEDLE_EVERY != 0]
    queries = []
    for _ in range(count):
        target = rng.choice(needles)
        order = [target, *rng.sample(plain, CHUNKS_PER_PROMPT - 1)]
        rng.shuffle(order)
        queries.append(Query(order, target))
    return queries


def touch_pool(llm: LLM) -> LLM:
    """Writes every KV page once. The pool is memory the OS maps on first touch; a server that
    has run a while has touched it, and a run that first-touches its blocks pays page faults
    (a fifth of a blend's time here), so every engine here starts touched."""
    for pages in llm.engine.runner.kv_cache.distinct_pages:
        pages.zero_()
    return llm


def drain(llm: LLM) -> None:
    """Runs the engine until idle: a cold blend computes its chunks after its first token."""
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def answer(llm: LLM, prompt: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    wall = time.perf_counter() - start
    drain(llm)
    m = out.metrics
    return {
        "tokens": out.outputs[0].token_ids,
        "text": out.outputs[0].text,
        "ttft_s": m.ttft_s,
        "wall_s": wall,
        "prompt_tokens": m.num_prompt_tokens,
        "cached_tokens": m.num_cached_tokens,
        "blended_tokens": m.num_blended_tokens,
        "recomputed_tokens": m.num_recomputed_tokens,
    }


def teacher_forced(
    llm: LLM, segments: list[str], reference: list[int], ratio: float, generated: list[int]
) -> float:
    """Share of answer positions whose argmax, with the reference answer as context, is the
    reference token (the answer appended to the question: its rows are recomputed).

    The free run of the same blend (`generated`) committed its blocks, so this request hits
    them as far as its tokens equal the free run's; a position before the first recomputed row
    has the free run's context exactly, so its argmax is the free run's token there.
    """
    prompt = llm.processor.process_segments(segments, "blend", ratio)
    prompt = dataclasses.replace(prompt, token_ids=prompt.token_ids + reference[:-1])
    runner = llm.engine.runner
    runner.capture_logits = True
    try:
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        drain(llm)
        assert runner.last_blend_logits is not None, "the prompt did not blend (chunks cold?)"
        positions, logits = runner.last_blend_logits
    finally:
        runner.capture_logits = False
        runner.last_blend_logits = None
    first = len(prompt.token_ids) - len(reference)  # position predicting reference[0]
    rows = {int(p): i for i, p in enumerate(positions.tolist())}
    predicted = []
    for j in range(len(reference)):
        if first + j in rows:
            predicted.append(int(logits[rows[first + j]].argmax()))
        else:
            assert first + j < min(rows), "a position after a recomputed row was not recomputed"
            predicted.append(generated[j])
    return sum(a == b for a, b in zip(predicted, reference)) / len(reference)


def needle_hit(run: dict[str, Any], chunk: Chunk) -> bool:
    return chunk.code in run["text"]


def summarize(runs: list[dict[str, Any]], chunks, queries, reference=None, agreement=None):
    ttfts = [r["ttft_s"] for r in runs]
    row = {
        "ttft_median_s": statistics.median(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts),
        "needle_accuracy": sum(needle_hit(r, chunks[q.target]) for r, q in zip(runs, queries))
        / len(runs),
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in runs),
        "cached_tokens_mean": statistics.fmean(r["cached_tokens"] for r in runs),
    }
    if runs[0]["blended_tokens"] is not None:
        row["blended_tokens_mean"] = statistics.fmean(r["blended_tokens"] for r in runs)
        row["recomputed_tokens_mean"] = statistics.fmean(r["recomputed_tokens"] for r in runs)
    if reference is not None:
        row["free_running_token_match"] = statistics.fmean(
            sum(a == b for a, b in zip(r["tokens"], ref)) / len(ref)
            for r, ref in zip(runs, reference)
        )
    if agreement is not None:
        row["teacher_forced_agreement"] = statistics.fmean(agreement)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--ratios", default="0,0.15,0.3")
    parser.add_argument("--check-layers", default="1,2,3")
    parser.add_argument("--pool", default="10GiB", help="KV pool of the caching engine")
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    options = dict(dtype=args.dtype, num_threads=args.threads)

    cold = touch_pool(LLM(enable_prefix_caching=False, kv_cache_memory="2GiB", **options))
    tokenizer = cold.tokenizer

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    chunks = build_corpus(count)
    queries = build_queries(args.queries)
    result: dict[str, Any] = {
        "cpu": cpu_label(),
        "dtype": args.dtype,
        "queries": args.queries,
        "chunk_tokens": [count(c.text) for c in chunks],
        "runs": {},
    }
    print(f"{len(chunks)} chunks of {min(result['chunk_tokens'])}-{max(result['chunk_tokens'])} "
          f"tokens; {args.queries} queries")

    full = [answer(cold, {"segments": q.segments(chunks)}) for q in queries]
    reference = [r["tokens"] for r in full]
    result["runs"]["no caching"] = summarize(full, chunks, queries)
    print("no caching", result["runs"]["no caching"])
    del cold
    gc.collect()

    # Room for every block one pass writes (64 chunks, then per query the blended prompt and
    # its teacher-forced twin), so no warm chunk is evicted within a pass.
    llm = touch_pool(LLM(kv_cache_memory=args.pool, **options))
    prefix = [answer(llm, {"segments": q.segments(chunks)}) for q in queries]
    assert [r["tokens"] for r in prefix] == reference, "prefix caching changed tokens"
    result["runs"]["prefix caching"] = summarize(prefix, chunks, queries)
    print("prefix caching", result["runs"]["prefix caching"])

    llm.reset_prefix_cache()
    cold_blend = []
    for q in queries:  # every chunk new for each query: the 0% reuse cost
        llm.reset_prefix_cache()
        cold_blend.append(answer(llm, {"segments": q.segments(chunks), "kv_reuse": "blend"}))
    result["runs"]["blend, 0% reuse"] = summarize(cold_blend, chunks, queries, reference)
    print("blend cold", result["runs"]["blend, 0% reuse"])

    def warm_all_chunks() -> float:
        """Empties the cache, then one cold blend prompt per chunk computes it after its first
        token: every chunk warm, nothing else cached."""
        llm.reset_prefix_cache()
        start = time.perf_counter()
        for c in chunks:
            llm.generate({"segments": [CONTEXT, c.text, "<|im_end|>\n"], "kv_reuse": "blend"},
                         SamplingParams(max_tokens=1), use_tqdm=False)
            drain(llm)
        return time.perf_counter() - start

    def blend_run(ratio: float, label: str) -> None:
        result["warm_all_chunks_s"] = warm_all_chunks()
        runs, agreement = [], []
        for q, ref in zip(queries, reference):
            blocks_before = llm.get_metrics().prefix_cache_evicted_blocks
            prompt = {"segments": q.segments(chunks), "kv_reuse": "blend", "recompute_ratio": ratio}
            runs.append(answer(llm, prompt))
            agreement.append(
                teacher_forced(llm, q.segments(chunks), ref, ratio, runs[-1]["tokens"])
            )
            assert llm.get_metrics().prefix_cache_evicted_blocks == blocks_before, (
                "blocks were evicted: raise --pool"
            )
        result["runs"][label] = summarize(runs, chunks, queries, reference, agreement)
        print(label, result["runs"][label])

    base = llm.engine.blends.settings
    for ratio in ratios:
        blend_run(ratio, f"blend r={ratio}")
    for layer in (int(x) for x in args.check_layers.split(",")):
        if layer == base.check_layer:
            continue
        llm.engine.blends.settings = BlendSettings(base.recompute_ratio, layer, base.min_reuse)
        blend_run(0.15, f"blend r=0.15 check layer {layer}")
    llm.engine.blends.settings = base
    result["default_check_layer"] = base.check_layer
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {OUT}")
    chart(result)


def chart(result: dict[str, Any]) -> None:
    """TTFT against teacher-forced agreement (left) and needle accuracy (right), per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    runs = [(label, row) for label, row in result["runs"].items() if "check layer" not in label]
    for ax, metric, name in (
        (axes[0], "teacher_forced_agreement", "teacher-forced agreement with full prefill (%)"),
        (axes[1], "needle_accuracy", "needles found (%)"),
    ):
        exact = 0
        for label, row in runs:
            value = 100 * row.get(metric, 1.0)
            ax.scatter(row["ttft_median_s"], value, s=40)
            # The exact runs sit together at full prefill's TTFT: stack their labels.
            offset = (-150, -12 * (exact := exact + 1)) if metric not in row or (
                "blend r" not in label
            ) else (5, 4)
            ax.annotate(label, (row["ttft_median_s"], value), fontsize=7, xytext=offset,
                        textcoords="offset points")
        ax.set_xlabel("TTFT, median (s)")
        ax.set_ylabel(name)
        ax.set_xlim(left=0)
    fig.suptitle(
        f"RAG prompts, 8 chunks of 256-512 tokens, {result['queries']} queries "
        f"({result['dtype']}, {result['cpu']})", fontsize=9,
    )
    fig.tight_layout()
    CHART.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(CHART, dpi=110)
    plt.close(fig)
    print(f"wrote {CHART}")


if __name__ == "__main__":
    main()
