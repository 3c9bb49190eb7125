"""Single-stream decode with and without speculative decoding, on three sets: code edits (a
file in the prompt, the reply rewrites it with one change), repeats (a second request asks
what an earlier one asked: an agent resending a step), and plain chat (nothing to copy).

    python -m benchmarks.micro.bench_spec_decode [--weights native] [--max-tokens 256]
        [--configs plain,ngram,suffix] [--sets code_edit,repeat,chat] [--dump-prompts PATH]

--dump-prompts writes the sets' prompts as token ids (the chat template applied, as kvmemo
sends them) with the GGUF's path, for llama.cpp's run of the same ids
(benchmarks/peers/llamacpp_spec.py).

Greedy, one request at a time, prompts cached first (the figure is decode: tokens after the
first over the time after the first). Each config runs in its own engine, the sets in turn;
configs alternate per prompt in one process. Prints tokens/s, the speed-up over plain and
the drafts' acceptance; writes benchmarks/results/spec_decode.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.machine_info import cpu_label
from benchmarks.paths import RESULTS
from kvmemo import LLM, SamplingParams
from kvmemo.intake.prompt_input import PromptInput

FILES = [
    '''import json
from dataclasses import dataclass


@dataclass
class Settings:
    name: str
    retries: int = 3
    timeout_s: float = 10.0

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "retries": self.retries, "timeout_s": self.timeout_s})


def load(path: str) -> Settings:
    with open(path) as f:
        data = json.load(f)
    return Settings(data["name"], data.get("retries", 3), data.get("timeout_s", 10.0))
''',
    '''def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None

    def __len__(self):
        return len(self.items)
''',
    '''import os


def list_python_files(root):
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                found.append(os.path.join(directory, name))
    return sorted(found)


def count_lines(path):
    with open(path) as f:
        return sum(1 for _ in f)


def total_lines(root):
    return sum(count_lines(p) for p in list_python_files(root))
''',
]
EDITS = ["rename the class Settings to Config", "rename the function mean to average",
         "rename the method peek to top", "rename the function count_lines to line_count"]
CHATS = ["What are three tips for staying focused while studying?",
         "Explain what a hash table is to a beginner.",
         "Write a short poem about the sea.",
         "Why is the sky blue? Answer in a short paragraph."]
REPEATS = ["List the planets of the solar system in order, one per line, with one fact each.",
           "Give step by step instructions to make a cup of tea."]
CONFIGS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 8},
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
}


def prompts(name: str) -> list[list[dict]]:
    if name == "code_edit":
        return [[{"role": "user", "content": f"Here is a Python file:\n\n{code}\nRewrite the "
                  f"whole file and {edit}. Output only the code."}]
                for code, edit in zip(FILES, EDITS)]
    if name == "repeat":  # each asked twice: the second is measured
        return [[{"role": "user", "content": q}] for q in REPEATS for _ in range(2)]
    return [[{"role": "user", "content": q}] for q in CHATS]


def decode_rate(llm: LLM, chat: list[dict], max_tokens: int) -> tuple[float, int, int, int]:
    """(tokens/s after the first token, tokens, drafted, accepted) of one greedy reply."""
    llm.chat([chat], SamplingParams(max_tokens=1), use_tqdm=False)  # the prompt, cached
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    out = llm.chat([chat], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    first = out.metrics.ttft_s or 0.0
    n = len(out.outputs[0].token_ids)
    rate = (n - 1) / max(elapsed - first, 1e-9)
    return rate, n, out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="native")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--configs", default="plain,ngram,suffix")
    parser.add_argument("--sets", default="code_edit,repeat,chat")
    parser.add_argument("--dump-prompts", default=None, metavar="PATH")
    args = parser.parse_args()
    if args.dump_prompts:
        llm = LLM(weights=args.weights)
        sets = {name: [llm.engine.processor.process(PromptInput(messages=chat)).token_ids
                       for chat in prompts(name)] for name in args.sets.split(",")}
        data = {"model": llm.engine.loaded.path, "max_tokens": args.max_tokens, "sets": sets}
        Path(args.dump_prompts).write_text(json.dumps(data))
        return
    names = args.configs.split(",")
    engines = {n: LLM(weights=args.weights, speculative_config=CONFIGS[n]) for n in names}
    results: dict = {"cpu": cpu_label(), "weights": args.weights, "sets": {}}
    for set_name in args.sets.split(","):
        chats = prompts(set_name)
        totals = {n: [0.0, 0, 0, 0] for n in names}  # seconds, tokens, drafted, accepted
        for i, chat in enumerate(chats):
            for n in names:
                rate, tokens, drafted, kept = decode_rate(engines[n], chat, args.max_tokens)
                if set_name == "repeat" and i % 2 == 0:
                    continue  # the first asking teaches the suffix index; the second counts
                totals[n][0] += (tokens - 1) / rate
                totals[n][1] += tokens - 1
                totals[n][2] += drafted
                totals[n][3] += kept
        base = totals[names[0]][1] / totals[names[0]][0]
        row = {}
        for n in names:
            seconds, tokens, drafted, kept = totals[n]
            rate = tokens / seconds
            # tokens / (tokens - accepted): the speed-up if verifying a draft cost nothing
            # (each kept token saves one step), what the copied share of the replies allows.
            row[n] = {"tok_s": round(rate, 1), "speedup": round(rate / base, 2),
                      "drafted": drafted, "accepted": kept, "tokens": tokens,
                      "free_verify_bound": round(tokens / (tokens - kept), 2)}
            print(f"{set_name:10s} {n:7s} {rate:6.1f} tok/s  x{rate / base:4.2f}  "
                  f"accepted {kept}/{drafted} of {tokens} tokens  "
                  f"(bound with free verification x{tokens / (tokens - kept):4.2f})")
        results["sets"][set_name] = row
    (RESULTS / "spec_decode.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
