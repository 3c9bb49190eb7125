"""CorpusLog: the suffix corpus saved beside the persistent KV store, so a restarted server
drafts from what it saw before it stopped (its KV comes back from the store, its drafts from
here).

One file per model namespace in the disk store's directory (`spec-corpus.jsonl`): a line per
finished sequence, `<crc32 hex> <json>`, json = {"salt", "prompt", "output", "mm", "greedy"}.
A line whose checksum fails (a torn write, an edit) is skipped, as a corrupt block is a miss.
Past max_bytes the file is rewritten with its newest half. A write that fails (a full disk)
stops the saving and logs it once; serving goes on.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

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
        self.path = Path(directory) / FILE_NAME
        self.max_bytes = max_bytes
        self.paused_reason: str | None = None

    def read(self) -> Iterator[CorpusRecord]:
        """Every intact record, oldest first (none when the file is missing or unreadable)."""
        try:
            lines = self.path.read_bytes().splitlines()
        except OSError:
            return
        skipped = 0
        for line in lines:
            record = _parse(line)
            if record is None:
                skipped += 1
            else:
                yield record
        if skipped:
            logger.warning("%s: %d damaged lines skipped", self.path, skipped)

    def append(self, record: CorpusRecord) -> None:
        if self.paused_reason is not None:
            return
        body = json.dumps({
            "salt": record.salt, "prompt": record.prompt, "output": record.output,
            "mm": [h.hex() for h in record.mm_hashes], "greedy": record.greedy,
        }, separators=(",", ":")).encode()
        line = b"%08x %s\n" % (zlib.crc32(body), body)
        try:
            with open(self.path, "ab") as f:
                f.write(line)
                size = f.tell()
            if size > self.max_bytes:
                self._keep_newest_half()
        except OSError as exc:
            self.paused_reason = str(exc)
            logger.warning("speculative corpus not saved any more (%s): %s", self.path, exc)

    def _keep_newest_half(self) -> None:
        lines = self.path.read_bytes().splitlines(keepends=True)
        kept = lines[len(lines) // 2 :]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, self.path)


def _parse(line: bytes) -> CorpusRecord | None:
    checksum, _, body = line.partition(b" ")
    try:
        if int(checksum, 16) != zlib.crc32(body):
            return None
        data = json.loads(body)
        return CorpusRecord(
            salt=data["salt"], prompt=[int(t) for t in data["prompt"]],
            output=[int(t) for t in data["output"]],
            mm_hashes=[bytes.fromhex(h) for h in data["mm"]], greedy=bool(data["greedy"]),
        )
    except (ValueError, KeyError, TypeError):
        return None
