"""Benchmark workloads W0-W2 (W4 replays W1): seeded, built with the model's own tokenizer.

Invariant: the same seed and tokenizer give the same token ids, so every engine runs exactly the
same requests from the same JSON file; token counts in the file are exact, not estimates.

Run: `python -m benchmarks.workloads` writes one JSON per workload to
benchmarks/generated_workloads/ (ignored by git; runners.run_suite rewrites it before each suite).
Stdlib only at import: runners.run imports this module inside the peers' virtualenvs.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.paths import GENERATED_WORKLOADS

WORKLOADS = ("W0", "W1", "W2", "W4")
DEFAULT_SEED = 0
OUTPUT_TOKENS = 32

# Plain English words: every engine's tokenizer handles them, and random orders of them give
# prompts that share no prefix beyond what a workload shares on purpose.
_WORDS = (
    "river stone light market garden window paper silver engine forest music winter harbor "
    "letter mountain coffee station orange bridge candle yellow quiet travel history number "
    "village morning island ocean signal pocket blanket planet kitchen thunder meadow valley "
    "castle button rocket pencil shadow mirror ladder basket cotton copper marble"
).split()


@dataclass
class Workload:
    """One workload as every engine runs it. `requests` are whole prompts (W0, W1, W4);
    `conversations` are multi-turn chats whose later prompts embed the engine's own answers (W2).
    """

    name: str
    description: str
    seed: int
    max_tokens: int
    tokenizer: str  # the tokenizer's name_or_path, for the record
    requests: list[dict[str, Any]] = field(default_factory=list)  # {"id", "prompt_token_ids"}
    conversations: list[dict[str, Any]] = field(default_factory=list)
    # W2: the tokens that close an assistant answer before the next user turn.
    answer_end_token_ids: list[int] = field(default_factory=list)
    shared_prefix_tokens: int = 0  # tokens every request shares on purpose (W1: the system prompt)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        return cls(**json.loads(text))

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r["prompt_token_ids"]) for r in self.requests)


def _words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def _exact_tokens(tokenizer: Any, rng: random.Random, num_tokens: int) -> list[int]:
    """Exactly num_tokens token ids of random plain words (no special tokens)."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids = tokenizer(_words(rng, num_tokens * 2), add_special_tokens=False)["input_ids"]
    return list(ids[:num_tokens])


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _system_text(tokenizer: Any, rng: random.Random, target_tokens: int) -> str:
    """A system message of about target_tokens tokens once rendered (words added until reached)."""
    words: list[str] = ["You are a helpful assistant. Reference notes:"]
    def rendered_len() -> int:
        return len(_chat_ids(tokenizer, [{"role": "system", "content": " ".join(words)}], False))

    while (missing := target_tokens - rendered_len()) > 0:
        words.append(_words(rng, max(1, missing // 2)))  # halving steps: lands on or just past
    return " ".join(words)


def build_w0(tokenizer: Any, seed: int = DEFAULT_SEED, num_requests: int = 32, prompt_tokens: int = 1056) -> Workload:
    """W0: distinct prompts with no shared prefix at all, not even their first token."""
    rng = random.Random(f"W0-{seed}")
    requests = []
    first_tokens = rng.sample(range(1000, 20000), num_requests)  # distinct first tokens
    for i in range(num_requests):
        body = _exact_tokens(tokenizer, rng, prompt_tokens - 1)
        requests.append({"id": f"w0-{i}", "prompt_token_ids": [first_tokens[i], *body]})
    return Workload("W0", f"{num_requests} distinct {prompt_tokens}-token prompts, no shared prefix",
                    seed, OUTPUT_TOKENS, tokenizer.name_or_path, requests=requests)


def build_w1(tokenizer: Any, seed: int = DEFAULT_SEED, num_requests: int = 32,
             system_tokens: int = 1024, question_tokens: int = 32) -> Workload:
    """W1: one ~1,024-token system prompt shared by every request + a distinct question each."""
    rng = random.Random(f"W1-{seed}")
    system = {"role": "system", "content": _system_text(tokenizer, rng, system_tokens)}
    system_ids = _chat_ids(tokenizer, [system], False)
    requests = []
    for i in range(num_requests):
        question = tokenizer.decode(_exact_tokens(tokenizer, rng, question_tokens))
        ids = _chat_ids(tokenizer, [system, {"role": "user", "content": f"{i}: {question}"}], True)
        if ids[: len(system_ids)] != system_ids:
            raise RuntimeError("the chat template does not render the system turn as a stable prefix")
        requests.append({"id": f"w1-{i}", "prompt_token_ids": ids})
    return Workload("W1", f"one {len(system_ids)}-token system prompt + {num_requests} distinct "
                    f"~{question_tokens}-token questions", seed, OUTPUT_TOKENS,
                    tokenizer.name_or_path, requests=requests, shared_prefix_tokens=len(system_ids))


def build_w2(tokenizer: Any, seed: int = DEFAULT_SEED, num_conversations: int = 8, num_turns: int = 4,
             system_tokens: int = 256, question_tokens: int = 48) -> Workload:
    """W2: multi-turn chats. Turn t's prompt = turn t-1's prompt + the engine's own answer +
    answer_end_token_ids + user segment t, built by token concatenation so the answer's KV (the
    generated tokens) is exactly what the next turn can reuse."""
    rng = random.Random(f"W2-{seed}")
    conversations = []
    end_ids: list[int] = []
    for c in range(num_conversations):
        system = {"role": "system", "content": f"Conversation {c}. " + _system_text(tokenizer, rng, system_tokens)}
        system_ids = _chat_ids(tokenizer, [system], False)
        segments = []
        for t in range(num_turns):
            user = {"role": "user", "content": tokenizer.decode(_exact_tokens(tokenizer, rng, question_tokens))}
            with_user = _chat_ids(tokenizer, [system, user], True)
            segments.append(with_user[len(system_ids):])  # user turn + assistant header
        conversations.append({"id": f"w2-{c}", "system_token_ids": system_ids, "user_segments": segments})
        if not end_ids:
            closed = _chat_ids(tokenizer, [system, {"role": "user", "content": "a"},
                                           {"role": "assistant", "content": "b"}], False)
            opened = _chat_ids(tokenizer, [system, {"role": "user", "content": "a"}], True)
            answer = tokenizer("b", add_special_tokens=False)["input_ids"]
            end_ids = closed[len(opened) + len(answer):]
    return Workload("W2", f"{num_conversations} conversations x {num_turns} turns, each turn's "
                    "prompt holding the earlier turns and the engine's own answers", seed,
                    OUTPUT_TOKENS, tokenizer.name_or_path, conversations=conversations,
                    answer_end_token_ids=end_ids)


def bundled_tokenizer() -> Any:
    """The tokenizer of the bundled SmolLM2 GGUF, the one every engine's requests are built with."""
    from kvmemo.model.loading.loader import bundled_model_path, fingerprint_files
    from kvmemo.model.loading.tokenizer import load_gguf_tokenizer

    path = Path(bundled_model_path())
    tokenizer = load_gguf_tokenizer(path, fingerprint_files([path], path.parent))
    tokenizer.name_or_path = path.name  # the record names the model file, not a cache directory
    return tokenizer


def build_workload(name: str, tokenizer: Any, seed: int = DEFAULT_SEED, scale: float = 1.0) -> Workload:
    """Builds one workload; scale < 1 shrinks request counts and lengths for quick smoke runs."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {list(WORKLOADS)}, got {name!r}")
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale!r}")

    def n(x: int) -> int:
        return max(2, round(x * scale))

    if name == "W0":
        return build_w0(tokenizer, seed, n(32), n(1056))
    if name == "W2":
        return build_w2(tokenizer, seed, n(8), 4 if scale == 1 else 2, n(256), n(48))
    w1 = build_w1(tokenizer, seed, n(32), n(1024), 32)
    if name == "W4":  # W1 again, in a fresh process over the same disk store (run_suite does it)
        w1.name, w1.description = "W4", "W1 in one process, then again in a fresh process on the same disk store"
    return w1


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the benchmark workloads as JSON.")
    parser.add_argument("--out", default=str(GENERATED_WORKLOADS), help="directory")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink for smoke runs, (0, 1]")
    args = parser.parse_args()
    tokenizer = bundled_tokenizer()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in WORKLOADS:
        w = build_workload(name, tokenizer, args.seed, args.scale)
        (out / f"{name}.json").write_text(w.to_json())
        print(f"{name}: {w.description} -> {out / (name + '.json')}")


if __name__ == "__main__":
    main()
