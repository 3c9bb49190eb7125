"""ReplicaBlockIndex: which block hashes one replica holds, kept from its KV events and snapshots.

Invariant: the index equals the replica's block map as of `last_seq` (plus hashes the router
predicted, see note_routed), as long as batches arrive in order; the first batch whose seq is not
last_seq + 1 marks it stale (a gap) until resync() installs a snapshot, after which the batches
buffered meanwhile that are newer than the snapshot are applied.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

from kvmemo.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmemo.kv.hashing import BlockHash
from kvmemo.server.kv_events import TOPIC, EventBatch, decode_batch

logger = logging.getLogger(__name__)

_MAX_BUFFERED = 10_000  # batches kept while waiting for a snapshot


class ReplicaBlockIndex:
    """Owns one replica's hash set, its last applied seq, and the gap and resync counters."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.epoch: str | None = None  # the publisher's epoch the index follows
        self.last_seq: int | None = None  # None: never synced
        self.needs_resync = True
        self.num_gaps = 0
        self.num_resyncs = 0
        self._buffer: list[EventBatch] = []

    def matched_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix of block_hashes this replica holds."""
        n = 0
        for h in block_hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def note_routed(self, block_hashes: Iterable[BlockHash]) -> None:
        """The router sent these blocks' prompt here: they will be cached soon (a prediction,
        confirmed by BlockStored, undone by BlockRemoved or the next snapshot)."""
        self.hashes.update(block_hashes)

    def apply(self, batch: EventBatch) -> bool:
        """Applies an in-order batch; returns False if a resync is needed (gap or not synced)."""
        if self.needs_resync:
            self._hold(batch)
            return False
        assert self.last_seq is not None
        if batch.epoch == self.epoch and batch.seq <= self.last_seq:
            return True  # already covered by the snapshot or a duplicate
        if batch.epoch != self.epoch or batch.seq != self.last_seq + 1:
            self.num_gaps += 1
            logger.warning(
                "KV events: gap (got %s/%d after %s/%d); resyncing from a snapshot",
                batch.epoch,
                batch.seq,
                self.epoch,
                self.last_seq,
            )
            self.needs_resync = True
            self._hold(batch)
            return False
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.hashes.clear()
        self.last_seq = batch.seq
        return True

    def resync(self, epoch: str, snapshot_seq: int, block_hashes: Iterable[bytes]) -> bool:
        """Installs a snapshot taken at (epoch, snapshot_seq), then the buffered newer batches.

        Returns False if the buffer still has a gap after the snapshot (resync again).
        """
        self.hashes = set(block_hashes)
        self.epoch = epoch
        self.last_seq = snapshot_seq
        self.needs_resync = False
        self.num_resyncs += 1
        buffered = sorted((b for b in self._buffer if b.epoch == epoch), key=lambda b: b.seq)
        self._buffer = []
        for i, batch in enumerate(buffered):
            if not self.apply(batch):
                self._buffer.extend(buffered[i + 1 :])
                return False
        return True

    def _hold(self, batch: EventBatch) -> None:
        self._buffer.append(batch)
        if len(self._buffer) > _MAX_BUFFERED:
            del self._buffer[0]


Snapshot = Callable[[], Awaitable[tuple[str, int, list[bytes]]]]  # (epoch, seq, hashes)


async def follow_events(
    endpoint: str, index: ReplicaBlockIndex, snapshot: Snapshot, *, name: str = ""
) -> None:
    """Subscribes to a replica's KV events until cancelled, keeping `index` current.

    Syncs from `snapshot` first, then after every gap; a failed snapshot is retried with each
    later batch. Malformed messages are logged and skipped (the next good one shows the gap).
    """
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
    socket.connect(endpoint)

    async def sync() -> None:
        while index.needs_resync:
            try:
                epoch, seq, hashes = await snapshot()
            except Exception as exc:  # the replica may be down: the next batch retries
                logger.warning("KV events %s: snapshot failed (%s)", name or endpoint, exc)
                return
            index.resync(epoch, seq, hashes)

    try:
        await sync()
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 2 or frames[0] != TOPIC:
                continue
            try:
                batch = decode_batch(frames[1])
            except ValueError as exc:
                logger.warning("KV events %s: %s", name or endpoint, exc)
                continue
            if not index.apply(batch):
                await sync()
    finally:
        socket.close(linger=0)
        context.term()
