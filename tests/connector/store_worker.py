"""Run one engine process against a KV store and print its tokens and metrics as JSON.

Used by the cross-process tests and the benchmark: `python -m tests.connector.store_worker
STORE_DIR [--max-tokens N] [--no-store]`. Not a test module itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def long_prompt(num_words: int = 700) -> str:
    """A deterministic prompt of about 1,000 SmolLM2 tokens for num_words=700."""
    words = [
        "river",
        "stone",
        "lantern",
        "harbor",
        "maple",
        "copper",
        "violet",
        "thunder",
        "meadow",
        "signal",
    ]
    parts = [
        f"{words[(i * 7) % 10]} {i}" if i % 5 == 0 else words[(i * 3) % 10]
        for i in range(num_words)
    ]
    return "Notes from the archive: " + " ".join(parts) + ". Summary of the notes:"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("store_dir")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--num-words", type=int, default=700)
    parser.add_argument("--no-store", action="store_true")
    args = parser.parse_args(argv)

    from kvmemo import LLM, SamplingParams

    options = {} if args.no_store else {"kv_store": f"disk:{args.store_dir}"}
    llm = LLM(num_blocks=256, device="cpu", **options)
    start = time.perf_counter()
    out = llm.generate(
        [long_prompt(args.num_words)],
        SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    elapsed_s = time.perf_counter() - start
    llm.engine.flush_kv_store()
    result = {
        "token_ids": out.outputs[0].token_ids,
        "num_prompt_tokens": out.metrics.num_prompt_tokens,
        "num_cached_tokens": out.metrics.num_cached_tokens,
        "ttft_s": out.metrics.first_token_time - out.metrics.arrival_time,
        "elapsed_s": elapsed_s,
        "metrics": llm.get_metrics().as_dict(),
    }
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
