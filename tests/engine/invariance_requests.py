"""The requests of the batch-invariance checks (test_batch_invariance.py), and a worker that
answers them in its own process: `python -m tests.engine.invariance_requests MODEL STORE
[--requests N]` prints the answers as JSON (floats round-trip exactly through JSON)."""

from __future__ import annotations

import argparse
import json

from kvmemo import LLM, SamplingParams

SYSTEM = ("You are the help desk of a city library. It opens at nine and closes at six, lends "
          "books for three weeks and renews them twice. ")
TOPICS = ["rivers", "bread", "volcanoes", "chess", "tides", "glass", "owls", "trains"]


def prompts(count: int) -> list[str]:
    """`count` prompts of mixed lengths (about 5 to 120 tokens); every other one opens with the
    same system text, so a batching engine would share its blocks (cascade) and its cache."""
    out = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        body = f"Question {i}: tell me about {topic}. " + f"More about {topic}, please. " * (i % 11)
        out.append(SYSTEM + body if i % 2 == 0 else body)
    return out


def params(count: int) -> list[SamplingParams]:
    """Greedy with logprobs for most; every fourth samples at a temperature with its own seed
    (its draws then depend on nothing but the seed and its logits)."""
    return [
        SamplingParams(max_tokens=6, temperature=0.8, seed=i, logprobs=2, ignore_eos=True)
        if i % 4 == 3 else
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
        for i in range(count)
    ]


Answer = tuple[list[int], list[dict[int, float]]]


def answers(llm: LLM, count: int, only: list[int] | None = None) -> list[Answer]:
    """Requests [0, count) (or those in `only`) in one generate call: (token ids, logprobs)."""
    chosen = only if only is not None else list(range(count))
    texts, sampling = prompts(count), params(count)
    outs = llm.generate([texts[i] for i in chosen], [sampling[i] for i in chosen],
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids), _plain(o.outputs[0].logprobs)) for o in outs]


def _plain(logprobs) -> list[dict[int, float]]:
    return [{int(t): float(v) for t, v in step.items()} for step in logprobs or []]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("store", help="a kv_store spec, e.g. disk:/tmp/store")
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    llm = LLM(args.model, kv_store=args.store, kv_cache_memory="256MiB")
    result = answers(llm, args.requests)
    llm.engine.flush_kv_store()
    print(json.dumps({"answers": result, "store_hit_tokens": llm.get_metrics().store_hit_tokens}))


if __name__ == "__main__":
    main()
