"""Trace requests as the replay reads them: Mooncake's JSON lines (`timestamp` ms,
`input_length`, `output_length`, `hash_ids`: one id per block of the input, the last possibly
partial; equal ids mean an equal prefix up to there).

Invariant: a request's blocks are its hash ids in order, block i covering tokens
[i * block_tokens, min((i + 1) * block_tokens, input_length)).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, index: int, block_tokens: int) -> int:
        """Tokens of the request's block `index` (the last block may be partial)."""
        return max(0, min(block_tokens, self.input_length - index * block_tokens))


def read_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests in order (at most `limit`); a malformed line names its number."""
    requests = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                requests.append(TraceRequest(float(row["timestamp"]), int(row["input_length"]),
                                             int(row["output_length"]),
                                             tuple(int(h) for h in row["hash_ids"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not a Mooncake trace line "
                                 f"(timestamp, input_length, output_length, hash_ids): {e}") from e
    return requests
