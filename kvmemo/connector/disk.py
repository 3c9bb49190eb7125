"""DiskStore: blocks as files <root>/<namespace dir>/<hh>/<hash hex>.kvb, capacity-capped by an
eviction policy (LRU or aged-arc, kvmemo/kv/keyed_eviction.py), crash-safe.

Invariant: a .kvb file is either absent or complete (temp file + fsync + os.replace); a file that
does not decode (truncated, flipped, foreign) is a miss and is removed; a write failure pauses
saving, never serving; the engine thread never waits on the disk for a save.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvmemo.connector.save_queue import SaveQueue
from kvmemo.connector.store import (
    InvalidBlock,
    StatsCounter,
    StoreNamespace,
    StoreStats,
    decode_block_checked,
    encode_block,
)
from kvmemo.kv.hashing import BlockHash
from kvmemo.kv.keyed_eviction import make_keyed_eviction

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 600.0  # temp files older than this at startup are leftovers of a crash
_PAUSE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


class DiskStore:
    """Owns one namespace directory: its in-memory index and eviction order, the write queue and
    writer thread.

    Promises: get() returns a validated payload or None and never raises on bad files; put()
    never blocks (a full queue drops the save and counts it); the directory's .kvb bytes stay at
    most capacity_bytes as seen by this process (other processes sharing the directory keep their
    own index, so the cap is per process, approximately shared).
    """

    kind = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        namespace: StoreNamespace,
        *,
        max_queue_bytes: int = 256 * 2**20,
        eviction: str = "lru",
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes!r}")
        self.root = Path(path)
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        self.dir = self.root / namespace.dir_name
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"kv_store directory {self.dir} cannot be created: {exc}") from exc
        self._lock = threading.Lock()
        self._index: dict[bytes, int] = {}  # hash -> file bytes
        # The victim order over _index's keys: after a restart, files come back oldest mtime
        # first (a read touches its file), each as written; what aged-arc learned is not kept.
        capacity_entries = capacity_bytes // max(1, namespace.payload_bytes)
        self._order = make_keyed_eviction(eviction, capacity_entries)
        self._total_bytes = 0
        self._counter = StatsCounter()
        self._count = self._counter.count
        self._paused_reason: str | None = None
        self._scan()
        max_items = max(2, max_queue_bytes // max(1, namespace.payload_bytes))
        # Flushes pending saves at interpreter exit (or when the store is collected).
        self._saves = SaveQueue(self._write_batch, max_items, name="kvmemo-disk-store")

    # ---- paths and index -------------------------------------------------------------------

    def path_of(self, block_hash: BlockHash) -> Path:
        """<dir>/<first 2 hex>/<hex>.kvb: the name comes from the hash alone."""
        hex_hash = bytes(block_hash).hex()
        return self.dir / hex_hash[:2] / f"{hex_hash}{SUFFIX}"

    def _scan(self) -> None:
        """Builds the LRU index from the files present (oldest mtime first)."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        with os.scandir(self.dir) as fan_out:
            for sub in fan_out:
                if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                    continue
                with os.scandir(sub.path) as entries:
                    for entry in entries:
                        name = entry.name
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if name.endswith(_TMP_SUFFIX):
                            if now - st.st_mtime > _STALE_TMP_S:
                                _remove_quietly(entry.path)
                            continue
                        if not name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
                            continue
                        try:
                            key = bytes.fromhex(name[: -len(SUFFIX)])
                        except ValueError:
                            continue
                        found.append((st.st_mtime, key, st.st_size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._order.insert(key)
            self._total_bytes += size
        if found:
            logger.info(
                "KV store %s: %d blocks, %.1f MiB", self.dir, len(found), self._total_bytes / 2**20
            )

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._total_bytes

    @property
    def stats(self) -> StoreStats:
        return self._counter.stats

    @property
    def is_saving_paused(self) -> bool:
        return self._paused_reason is not None

    # ---- read ------------------------------------------------------------------------------

    def contains(self, block_hash: BlockHash) -> bool:
        """In this process's index or queued for writing (a hint: files can vanish)."""
        key = bytes(block_hash)
        with self._lock:
            if key in self._index:
                return True
        return self._saves.is_queued(key)

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The validated payload, or None. Bad files are logged and removed; never raises OSError.

        Reads the disk even when the index lacks the hash: another process may have written it.
        A hit touches the file's mtime, so the LRU order survives restarts.
        """
        key = bytes(block_hash)
        path = self.path_of(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            self._count(num_misses=1)
            return None
        except IsADirectoryError:
            logger.warning(
                "KV store: %s is a directory, not a block file; treating it as a miss", path
            )
            _rmdir_quietly(path)
            self._forget(key)
            self._count(num_misses=1, num_invalid=1)
            return None
        except OSError as exc:
            logger.warning("KV store: cannot read %s (%s); treating it as a miss", path, exc)
            self._count(num_misses=1)
            return None
        try:
            payload = decode_block_checked(self.namespace, block_hash, data)
        except InvalidBlock as exc:
            logger.warning("KV store: %s is invalid (%s); removed, treated as a miss", path, exc)
            _remove_quietly(path)
            self._forget(key)
            self._count(num_misses=1, num_invalid=1)
            return None
        try:
            os.utime(path)
        except OSError:
            pass  # a read-only store still serves; its LRU order just does not advance on disk
        with self._lock:
            self._total_bytes += len(data) - self._index.get(key, 0)
            self._index[key] = len(data)
            self._order.insert(key)  # a read: refreshed (aged-arc: now a read entry)
        self._count(num_hits=1, bytes_read=len(payload))
        return payload

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """get() of each hash, in order; stops reading at the first miss (a prefix's chain is
        broken there), the rest are None."""
        out: list[bytes | None] = []
        for block_hash in block_hashes:
            payload = self.get(block_hash) if not out or out[-1] is not None else None
            out.append(payload)
        return out

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._total_bytes -= size
                self._order.discard(key)

    # ---- write -----------------------------------------------------------------------------

    def put(self, block_hash: BlockHash, payload: bytes) -> None:
        """Queues a save; returns at once.

        Dropped (and counted) when paused or the queue is full.
        """
        key = bytes(block_hash)
        with self._lock:
            if key in self._index:
                return
        if self._paused_reason is not None or not self._saves.offer(key, payload):
            self._count(num_saves_dropped=1)

    def flush(self) -> None:
        """Blocks until every queued save is written (or dropped)."""
        self._saves.flush()

    def close(self) -> None:
        """Flushes and stops the writer thread. Idempotent."""
        self._saves.close()

    def _write_batch(self, saves: list[tuple[bytes, bytes]]) -> None:
        for key, payload in saves:
            self._write(BlockHash(key), payload)

    def _write(self, block_hash: BlockHash, payload: bytes) -> None:
        if self._paused_reason is not None:
            self._count(num_saves_dropped=1)
            return
        start = time.perf_counter()
        data = encode_block(self.namespace, block_hash, payload)
        path = self.path_of(block_hash)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}")
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)  # atomic: readers see the old file, the new one, or none
        except OSError as exc:
            _remove_quietly(tmp)
            if exc.errno in _PAUSE_ERRNOS or isinstance(exc, PermissionError):
                self._pause(f"{exc.__class__.__name__}: {exc}")
            else:
                logger.warning("KV store: saving %s failed (%s); block not saved", path, exc)
            self._count(num_saves_dropped=1)
            return
        with self._lock:
            key = bytes(block_hash)
            self._total_bytes += len(data) - self._index.get(key, 0)
            self._index[key] = len(data)
            self._order.insert(key)
        self._count(bytes_written=len(data), save_s=time.perf_counter() - start)
        self._evict_over_capacity()

    def _pause(self, reason: str) -> None:
        if self._paused_reason is None:
            self._paused_reason = reason
            logger.warning(
                "KV store %s: saving paused (%s); loading and serving go on", self.dir, reason
            )

    def _evict_over_capacity(self) -> None:
        """Removes the policy's victims until the directory is under capacity."""
        while True:
            with self._lock:
                if self._total_bytes <= self.capacity_bytes or not self._index:
                    return
                key = self._order.pop_victim()
                assert isinstance(key, bytes)  # the order holds _index's keys only
                size = self._index.pop(key)
                self._total_bytes -= size
            _remove_quietly(self.path_of(BlockHash(key)))
            self._count(num_evicted=1)


def _remove_quietly(path: str | os.PathLike[str]) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("KV store: cannot remove %s (%s)", path, exc)


def _rmdir_quietly(path: Path) -> None:
    """Removes a stray directory only if it is empty (never deletes what someone put inside)."""
    try:
        os.rmdir(path)
    except OSError:
        pass
