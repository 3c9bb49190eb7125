"""ReplayIndex: the whole continuation of an earlier greedy run, drafted for a greedy request
whose prompt (token ids, images, cache_salt) is the same: an agent resending a step, a retry, a
cached answer asked again. Verified like any draft, so a replay can only save steps: the first
token that differs ends it, and the output is the model's own.

Only plain greedy runs are stored and replayed (temperature 0; no penalties, biases, bans,
minimum length or grammar, which would change the path); where a run stopped (EOS, a stop
string, max_tokens) does not matter, since any prefix of the greedy path is the greedy path.
Bounded in tokens, least recently replayed first out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from kvmemo.request import Request


def replayable(request: Request) -> bool:
    """A plain greedy request: its output is the model's greedy path for its prompt."""
    params = request.sampling_params
    return (
        params.is_greedy and not params.has_penalties and request.constraint is None
        and request.sample_tokens and request.blend is None and request.kv_marker is None
    )


def run_key(salt: str | None, prompt: Sequence[int], mm_hashes: Sequence[bytes]) -> bytes:
    """What makes two runs the same: the cache_salt, the prompt's ids and its images."""
    digest = hashlib.sha256(repr((salt, list(prompt))).encode())
    for content_hash in mm_hashes:
        digest.update(content_hash)
    return digest.digest()


class ReplayIndex:
    """Finished greedy runs' outputs by (cache_salt, prompt): what a same request replays."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._runs: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._runs)

    @staticmethod
    def key(request: Request) -> bytes:
        return run_key(request.cache_salt, request.prompt_token_ids,
                       [item.content_hash for item in request.mm_items])

    def add(self, request: Request) -> None:
        """Remember a finished plain greedy run (the longer one, if the prompt ran before)."""
        if replayable(request):
            self.add_run(self.key(request), request.output_token_ids)

    def add_run(self, key: bytes, output_ids: Sequence[int]) -> None:
        output = tuple(output_ids)
        if not output or len(output) > self.max_tokens:
            return
        known = self._runs.get(key)
        if known is not None and len(known) >= len(output):
            self._runs.move_to_end(key)
            return
        self.num_tokens += len(output) - (len(known) if known is not None else 0)
        self._runs[key] = output
        while self.num_tokens > self.max_tokens:
            _, dropped = self._runs.popitem(last=False)
            self.num_tokens -= len(dropped)

    def draft(self, request: Request, max_tokens: int) -> list[int]:
        """The stored run's tokens after the request's output so far, when the output so far is
        where that run went; [] otherwise."""
        if max_tokens <= 0 or not self._runs or not replayable(request):
            return []
        run = self._runs.get(self.key(request))
        n = request.num_output_tokens
        if run is None or len(run) <= n or list(run[:n]) != request.output_token_ids:
            return []
        self._runs.move_to_end(self.key(request))
        return list(run[n : n + max_tokens])
