"""CorpusLog: the suffix corpus saved beside the persistent KV store, so a restarted server
drafts from what it saw before it stopped (its KV comes back from the store, its drafts from
here).

One file per model namespace in the disk store's directory (`spec-corpus.jsonl`), a LineLog
(connector/line_log.py: checksummed lines, damaged ones skipped, bounded, a failed write stops
the saving): a record per finished sequence, {"salt", "prompt", "output", "mm", "greedy"}.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmemo.connector.line_log import LineLog

FILE_NAME = "spec-corpus.jsonl"


@dataclass(frozen=True)
class CorpusRecord:
    salt: str | None
    prompt: list[int]
    output: list[int]
    mm_hashes: list[bytes]
    greedy: bool  # a plain greedy run (replayable)


class CorpusLog:
    def __init__(self, directory: str | os.PathLike[str], max_bytes: int):
        self._log = LineLog(Path(directory) / FILE_NAME, max_bytes, "speculative corpus")
        self.path = self._log.path

    @property
    def paused_reason(self) -> str | None:
        return self._log.paused_reason

    def read(self) -> Iterator[CorpusRecord]:
        """Every intact record, oldest first (none when the file is missing or unreadable)."""
        for data in self._log.read():
            record = _record(data)
            if record is not None:
                yield record

    def append(self, record: CorpusRecord) -> None:
        self._log.append({
            "salt": record.salt, "prompt": record.prompt, "output": record.output,
            "mm": [h.hex() for h in record.mm_hashes], "greedy": record.greedy,
        })


def _record(data: dict[str, Any]) -> CorpusRecord | None:
    try:
        return CorpusRecord(
            salt=data["salt"], prompt=[int(t) for t in data["prompt"]],
            output=[int(t) for t in data["output"]],
            mm_hashes=[bytes.fromhex(h) for h in data["mm"]], greedy=bool(data["greedy"]),
        )
    except (ValueError, KeyError, TypeError):
        return None
