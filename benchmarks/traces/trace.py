"""Trace requests as the replay reads them, from two public formats of JSON lines:
- Mooncake's (FAST'25): `timestamp` (ms), `input_length`, `output_length`, `hash_ids`, one id per
  512-token block of the input, the last possibly partial; equal ids mean an equal prefix up to
  there.
- Alibaba Bailian's (Qwen serving traces): the same with `timestamp` in seconds, 16-token blocks,
  and a conversation's structure: `chat_id`, `parent_chat_id` (-1 for a first turn), `turn` and
  `type` (a workload tag).

Invariant: a request's blocks are its hash ids in order, block i covering tokens
[i * block_tokens, min((i + 1) * block_tokens, input_length)).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_FORMATS = ("mooncake", "alibaba")
BLOCK_TOKENS = {"mooncake": 512, "alibaba": 16}  # each format's block size


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    turn: int | None = None  # Alibaba's: the request's turn in its conversation (1: the first)
    parent_chat_id: int | None = None  # Alibaba's: the previous turn's chat_id, -1 for none
    kind: str | None = None  # Alibaba's `type`: a workload tag

    def block_tokens(self, index: int, block_tokens: int) -> int:
        """Tokens of the request's block `index` (the last block may be partial)."""
        return max(0, min(block_tokens, self.input_length - index * block_tokens))


def read_trace(path: str | Path, fmt: str = "auto",
               limit: int | None = None) -> tuple[str, list[TraceRequest]]:
    """The trace's format (`fmt`, or from its first line's keys with "auto") and requests."""
    if fmt == "auto":
        with open(path) as lines:
            first = next((line for line in lines if line.strip()), "{}")
        try:
            fmt = "alibaba" if "parent_chat_id" in json.loads(first) else "mooncake"
        except ValueError as e:
            raise ValueError(f"{path}:1: not a JSON-lines trace: {e}") from e
    if fmt == "mooncake":
        return fmt, read_mooncake(path, limit)
    if fmt == "alibaba":
        return fmt, read_alibaba(path, limit)
    raise ValueError(f"trace format must be one of {['auto', *TRACE_FORMATS]}, got {fmt!r}")


def read_alibaba(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of an Alibaba Bailian trace in order (at most `limit`); a malformed line
    names its number."""
    def parse(row: dict[str, Any]) -> TraceRequest:
        return TraceRequest(
            float(row["timestamp"]) * 1000.0, int(row["input_length"]), int(row["output_length"]),
            tuple(int(h) for h in row["hash_ids"]), turn=int(row["turn"]),
            parent_chat_id=int(row["parent_chat_id"]), kind=str(row.get("type", "")),
        )
    return _read_lines(path, limit, parse, "an Alibaba trace line (chat_id, parent_chat_id, "
                       "timestamp, input_length, output_length, turn, type, hash_ids)")


def read_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests in order (at most `limit`); a malformed line names its number."""
    def parse(row: dict[str, Any]) -> TraceRequest:
        return TraceRequest(float(row["timestamp"]), int(row["input_length"]),
                            int(row["output_length"]), tuple(int(h) for h in row["hash_ids"]))
    return _read_lines(path, limit, parse,
                       "a Mooncake trace line (timestamp, input_length, output_length, hash_ids)")


def _read_lines(path: str | Path, limit: int | None,
                parse: Callable[[dict[str, Any]], TraceRequest], what: str) -> list[TraceRequest]:
    requests = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                requests.append(parse(json.loads(line)))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not {what}: {e}") from e
    return requests
