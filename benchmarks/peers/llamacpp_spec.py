"""llama.cpp's prompt-lookup decoding beside kvmemo's speculative decoding: the same GGUF and
the same token ids (written by `bench_spec_decode --dump-prompts`), greedy, one request at a
time, in llama-cpp-python's own venv:

    benchmarks/peers/.venv-llamacpp/bin/python benchmarks/peers/llamacpp_spec.py PROMPTS.json

Per set: plain decode, and `LlamaPromptLookupDecoding` with its README's settings
(num_pred_tokens=10, "generally good for gpu", and 2, which it says "performs better for
cpu-only machines"); max_ngram_size 2 (its default). Threads: one per core (llama.cpp's best on
2 cores, measured in bench_gguf). Tokens/s after the first token, as kvmemo's bench reports.
The "repeat" set counts every second prompt (the first asking warms nothing in llama.cpp: it
keeps no corpus across requests). Prints JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time

import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def run(model: str, sets: dict, max_tokens: int, draft) -> dict:
    llm = llama_cpp.Llama(model_path=model, n_ctx=4096, n_threads=os.cpu_count() or 1,
                          n_batch=512, verbose=False, draft_model=draft)
    out = {}
    for name, prompts in sets.items():
        seconds, tokens = 0.0, 0
        for i, ids in enumerate(prompts):
            llm.reset()
            start, first, count = time.perf_counter(), None, 0
            for count, token in enumerate(llm.generate(ids, temp=0.0, top_k=1), 1):
                if first is None:
                    first = time.perf_counter()
                if token == llm.token_eos() or count == max_tokens:
                    break
            if name == "repeat" and i % 2 == 0:
                continue
            seconds += time.perf_counter() - (first or start)
            tokens += count - 1
        out[name] = {"tok_s": round(tokens / seconds, 1), "tokens": tokens}
    return out


def main() -> None:
    data = json.loads(open(sys.argv[1]).read())
    model, sets, max_tokens = data["model"], data["sets"], data["max_tokens"]
    result = {"version": f"llama-cpp-python {llama_cpp.__version__}",
              "plain": run(model, sets, max_tokens, None)}
    for n in (10, 2):
        result[f"prompt_lookup_{n}"] = run(
            model, sets, max_tokens, LlamaPromptLookupDecoding(num_pred_tokens=n))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
