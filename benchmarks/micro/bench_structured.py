"""Structured output's costs: the grammar library choice, and what a constrained request costs
the free requests batched with it.

    python -m benchmarks.micro.bench_structured backends   # needs: pip install llguidance
    python -m benchmarks.micro.bench_structured overhead

backends: xgrammar vs llguidance on SmolLM2's tokenizer (49,152 tokens): tokenizer setup, schema
compile time, and the time to fill 32 rows' token masks, the 32 matchers each at a different
point of a 64-token instance (so states differ across the batch), over the whole instance.
overhead: LLM.generate on 40 greedy prompts, 64 new tokens each, all free or 8 of them under a
regex that cannot complete in 64 tokens (so every one of their steps is masked): the difference
is what the grammar costs the batch. Writes benchmarks/results/structured.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.machine_info import cpu_label
from benchmarks.paths import RESULTS as RESULTS_DIR

BATCH = 32
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "kind": {"enum": ["book", "film", "song"]},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "authors": {"type": "array", "minItems": 1, "items": {
            "type": "object", "properties": {"first": {"type": "string"},
                                                           "last": {"type": "string"}},
            "required": ["first", "last"]}},
        "meta": {"type": "object", "additionalProperties": {"type": "string"}},
        "published": {"type": "boolean"}},
     "required": ["id", "kind", "score", "authors", "published"]},
]
# In the schema's property order: the compiled grammar (any_whitespace=False) writes that order.
INSTANCE = {"id": "ABC-1234", "kind": "book", "score": 7.5,
            "authors": [{"first": "Ada", "last": "Lovelace"}, {"first": "Alan", "last": "Turing"}],
            "published": True}


def _tokenizer():
    from kvmemo.model.loading.loader import bundled_model_path
    from kvmemo.model.loading.tokenizer import load_gguf_tokenizer

    path = Path(bundled_model_path())
    return load_gguf_tokenizer(path, "bench-structured-" + path.name)


def _mask_fill_ms(matchers, fill, accept, ids) -> list[float]:
    position = [i % len(ids) for i in range(len(matchers))]
    for matcher, p in zip(matchers, position):
        for token in ids[:p]:
            assert accept(matcher, token)
    times = []
    for _ in range(len(ids)):
        start = time.perf_counter()
        for row, matcher in enumerate(matchers):
            fill(matcher, row)
        times.append((time.perf_counter() - start) * 1e3)
        for row, matcher in enumerate(matchers):
            if position[row] < len(ids):
                assert accept(matcher, ids[position[row]])
                position[row] += 1
    return times


def _summary(setup_s: float, compile_ms: list[float], fill_ms: list[float]) -> dict:
    return {
        "tokenizer_setup_ms": round(setup_s * 1e3, 1),
        "schema_compile_ms": [round(t, 2) for t in compile_ms],
        "mask_fill_batch32_median_ms": round(statistics.median(fill_ms), 3),
        "mask_fill_batch32_max_ms": round(max(fill_ms), 3),
    }


def bench_xgrammar(tokenizer, vocab: int, ids: list[int]) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start
    compile_ms, compiled = [], None
    for schema in SCHEMAS:
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        compile_ms.append((time.perf_counter() - start) * 1e3)
    bitmask = xgr.allocate_token_bitmask(BATCH, vocab)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    fill = _mask_fill_ms(
        matchers, lambda m, row: m.fill_next_token_bitmask(bitmask, row),
        lambda m, t: m.accept_token(t), ids,
    )
    return _summary(setup, compile_ms, fill)


def bench_llguidance(tokenizer, vocab: int, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup = time.perf_counter() - start
    compile_ms, grammar = [], None
    for schema in SCHEMAS:
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        compile_ms.append((time.perf_counter() - start) * 1e3)
    bitmask = lt.allocate_token_bitmask(BATCH, vocab)
    matchers = [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in range(BATCH)]
    fill = _mask_fill_ms(
        matchers, lambda m, row: lt.fill_next_token_bitmask(m, bitmask, row),
        lambda m, t: m.consume_token(t), ids,
    )
    return _summary(setup, compile_ms, fill)


def backends() -> dict:
    tokenizer = _tokenizer()
    vocab = len(tokenizer)
    ids = tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False)
    results = {"instance_tokens": len(ids), "xgrammar": bench_xgrammar(tokenizer, vocab, ids)}
    try:
        results["llguidance"] = bench_llguidance(tokenizer, vocab, ids)
    except ImportError:
        print("llguidance not installed (pip install llguidance): skipped", file=sys.stderr)
    return results


def overhead(repeats: int = 5) -> dict:
    from kvmemo import LLM, SamplingParams
    from kvmemo.structured import StructuredOutputsParams

    llm = LLM()
    free = [f"Story {i}: once upon a time" for i in range(BATCH)]
    free_params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    regex = StructuredOutputsParams(regex="[A-Za-z ,.]{400}")
    constrained_params = SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=regex)
    plain_params = free_params

    def run(extra_params) -> float:
        prompts = free + [f"Record {i}:" for i in range(8)]
        params = [free_params] * BATCH + [extra_params] * 8
        llm.engine.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
        return elapsed

    run(constrained_params)  # warm up (compiles the grammar once)
    timings: dict[str, list[float]] = {"40 free": [], "32 free + 8 regex": []}
    for _ in range(repeats):  # interleaved
        for name, params in (("40 free", plain_params), ("32 free + 8 regex", constrained_params)):
            timings[name].append(run(params))
    return {name: {"median_s": round(statistics.median(t), 3)} for name, t in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["backends", "overhead"])
    args = parser.parse_args()
    result = {"machine": cpu_label(), args.what: backends() if args.what == "backends" else overhead()}
    print(json.dumps(result, indent=2))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / "structured.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved.update(result)
    path.write_text(json.dumps(saved, indent=2) + "\n")


if __name__ == "__main__":
    main()
