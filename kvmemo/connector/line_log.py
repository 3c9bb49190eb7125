"""LineLog: JSON records kept beside the disk KV store, one checksummed line each, so what a
server learned (its speculative corpus, its stored responses) outlives a restart as its KV does.

A line is `<crc32 hex> <json>`. A line whose checksum or JSON fails (a torn write, an edit) is
skipped, as a corrupt block is a miss. Past max_bytes the file is rewritten with its newest half.
A write that fails (a full disk) stops the saving and logs it once; serving goes on.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmemo.connector.store_connector import StoreKVConnector

logger = logging.getLogger(__name__)


class LineLog:
    def __init__(self, path: str | os.PathLike[str], max_bytes: int, what: str):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.what = what  # for the logs: "speculative corpus", "stored responses"
        self.paused_reason: str | None = None

    def read(self) -> Iterator[dict[str, Any]]:
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

    def append(self, record: dict[str, Any]) -> None:
        if self.paused_reason is not None:
            return
        body = json.dumps(record, separators=(",", ":")).encode()
        line = b"%08x %s\n" % (zlib.crc32(body), body)
        try:
            with open(self.path, "ab") as f:
                f.write(line)
                size = f.tell()
            if size > self.max_bytes:
                self._keep_newest_half()
        except OSError as exc:
            self.paused_reason = str(exc)
            logger.warning("%s not saved any more (%s): %s", self.what, self.path, exc)

    def _keep_newest_half(self) -> None:
        lines = self.path.read_bytes().splitlines(keepends=True)
        kept = lines[len(lines) // 2 :]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, self.path)


def disk_store_dir(connector: StoreKVConnector | None) -> Path | None:
    """The disk KV store's directory for this model's namespace, if a tier is a disk store."""
    store = connector.store if connector is not None else None
    for tier in getattr(store, "tiers", [store]):
        if tier is not None and tier.kind == "disk":
            return Path(tier.dir)
    return None


def _parse(line: bytes) -> dict[str, Any] | None:
    checksum, _, body = line.partition(b" ")
    try:
        if int(checksum, 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
