"""What runners.run needs from an engine: warm up, then run prompts arriving at given offsets.

Invariant: times are taken by this module's clock, from each request's arrival offset, for every
engine alike; a sequential engine serves requests in arrival order (queueing delay counts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Completion:
    token_ids: list[int]
    num_prompt_tokens: int
    ttft_s: float  # arrival -> first output token
    latency_s: float  # arrival -> last output token
    num_cached_tokens: int | None = None  # None where the engine does not report it


@dataclass
class EngineRunner:
    """Base of the per-engine runners. Subclasses implement either (engines with continuous
    batching) `submit(index, prompt_token_ids, max_tokens)` and `step() -> [(index, token_ids so
    far, finished, num_cached_tokens)]`, or (sequential engines) `generate_one(prompt_token_ids,
    max_tokens) -> (token_ids, perf_counter time of the first token, num_cached_tokens)`."""

    name: str
    version: str
    options: dict = field(default_factory=dict)
    startup_s: float = 0.0

    def warm_up(self) -> None:
        self.run([[1, 2, 3, 4, 5, 6, 7, 8]], [0.0], 2)

    def run(self, prompts: list[list[int]], offsets_s: list[float], max_tokens: int) -> list[Completion]:
        if hasattr(self, "step"):
            return self._run_batched(prompts, offsets_s, max_tokens)
        return self._run_sequential(prompts, offsets_s, max_tokens)

    def _run_batched(self, prompts, offsets_s, max_tokens) -> list[Completion]:
        start = time.perf_counter()
        first: dict[int, float] = {}
        done: dict[int, Completion] = {}
        next_index = 0
        while len(done) < len(prompts):
            now = time.perf_counter() - start
            while next_index < len(prompts) and offsets_s[next_index] <= now:
                self.submit(next_index, prompts[next_index], max_tokens)
                next_index += 1
            if next_index == len(done):  # nothing in flight: sleep until the next arrival
                time.sleep(max(0.0, offsets_s[next_index] - (time.perf_counter() - start)))
                continue
            for index, token_ids, finished, cached in self.step():
                now = time.perf_counter() - start
                if token_ids and index not in first:
                    first[index] = now
                if finished:
                    done[index] = Completion(token_ids, len(prompts[index]), first[index] - offsets_s[index],
                                             now - offsets_s[index], cached)
        return [done[i] for i in range(len(prompts))]

    def _run_sequential(self, prompts, offsets_s, max_tokens) -> list[Completion]:
        start = time.perf_counter()
        out = []
        for index, prompt in enumerate(prompts):
            time.sleep(max(0.0, offsets_s[index] - (time.perf_counter() - start)))
            token_ids, first_token_at, cached = self.generate_one(prompt, max_tokens)
            now = time.perf_counter()
            out.append(Completion(token_ids, len(prompt), first_token_at - start - offsets_s[index],
                                  now - start - offsets_s[index], cached))
        return out
