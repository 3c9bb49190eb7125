"""SaveQueue: a store's pending saves, written in order by one daemon writer thread.

Invariant: offer() never blocks; a key counts as queued from offer() until the write of its
batch returned or raised; close() (also at interpreter exit) writes everything queued first.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable

logger = logging.getLogger(__name__)

_STOP = object()

Save = tuple[bytes, bytes]  # (key, payload)


class SaveQueue:
    """Owns the bounded queue, the set of queued keys and the writer thread."""

    def __init__(
        self,
        write: Callable[[list[Save]], None],
        max_items: int,
        *,
        name: str,
        max_batch: int = 1,
    ) -> None:
        self._lock = threading.Lock()
        self._queued: set[bytes] = set()
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, max_items))
        self._writer = threading.Thread(
            target=_write_loop,
            args=(self._queue, self._queued, self._lock, write, max_batch, name),
            name=name,
            daemon=True,
        )
        self._writer.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._queue, self._writer)

    def is_queued(self, key: bytes) -> bool:
        with self._lock:
            return key in self._queued

    def offer(self, key: bytes, payload: bytes) -> bool:
        """Queues the save (True; also when that key is queued already); False when full."""
        with self._lock:
            if key in self._queued:
                return True
            self._queued.add(key)
        try:
            self._queue.put_nowait((key, payload))
        except queue.Full:
            with self._lock:
                self._queued.discard(key)
            return False
        return True

    def flush(self) -> None:
        """Blocks until every queued save is written (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Flushes and stops the writer thread. Idempotent."""
        self._finalizer()


def _write_loop(
    q: queue.Queue[object],
    queued: set[bytes],
    lock: threading.Lock,
    write: Callable[[list[Save]], None],
    max_batch: int,
    name: str,
) -> None:
    while True:
        batch = [q.get()]
        while len(batch) < max_batch:
            try:
                batch.append(q.get_nowait())
            except queue.Empty:
                break
        saves: list[Save] = [item for item in batch if item is not _STOP]  # type: ignore[misc]
        try:
            if saves:
                write(saves)
        except Exception:  # the writer must survive anything one batch does
            logger.exception("%s: unexpected error while saving blocks", name)
        finally:
            with lock:
                for key, _ in saves:
                    queued.discard(key)
            for _ in batch:
                q.task_done()
        if len(saves) < len(batch):  # _STOP came last: the queue is FIFO
            return


def _shutdown(q: queue.Queue[object], writer: threading.Thread) -> None:
    if writer.is_alive():
        q.put(_STOP)  # after every queued save
        writer.join(timeout=60)
