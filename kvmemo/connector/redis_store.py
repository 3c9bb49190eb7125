"""RedisStore: blocks as Redis values under "<prefix>:<namespace dir>:<hash hex>".

The values are shared by replicas.

Invariant: a value is served only if it decodes under this namespace and block hash (else a miss,
deleted); a lost connection is misses and one warning per outage, never an exception, and no call
holds the engine thread longer than the socket timeout; saves run on a writer thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

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

logger = logging.getLogger(__name__)

_MAX_BATCH = 32  # saves pipelined into one round trip by the writer
_MAX_KNOWN = 1 << 16  # hashes remembered as present (the contains() hint)
_OUTAGE_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class RedisStore:
    """Owns one Redis client, the connection state (up, or down until a backoff deadline), the
    write queue and its writer thread.

    Promises: get()/get_many() return validated payloads or None and never raise; while the
    server is down they return misses at once until the next retry time (backoff doubling from
    backoff_initial_s to backoff_max_s); put() never blocks. Eviction is Redis's own: run the
    server with maxmemory and `maxmemory-policy allkeys-lru`, and an evicted block is a miss.
    """

    kind = "redis"

    def __init__(
        self,
        url: str,
        namespace: StoreNamespace,
        *,
        timeout_s: float = 0.5,
        key_prefix: str = "kvmemo",
        max_queue_bytes: int = 256 * 2**20,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.url = url
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.key_prefix = f"{key_prefix}:{namespace.dir_name}:".encode()
        # No client-side retries: one failed call is one outage step, bounded by the timeout.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._lock = threading.Lock()
        self._counter = StatsCounter()
        self._count = self._counter.count
        self._num_errors = 0
        self._down_reason: str | None = None
        self._retry_at = 0.0
        self._backoff_s = backoff_initial_s
        self._known: OrderedDict[bytes, None] = OrderedDict()  # present in Redis, as last seen
        max_items = max(2, max_queue_bytes // max(1, namespace.payload_bytes))
        self._saves = SaveQueue(
            self._write, max_items, name="kvmemo-redis-store", max_batch=_MAX_BATCH
        )

    def key_of(self, block_hash: BlockHash) -> bytes:
        return self.key_prefix + bytes(block_hash).hex().encode("ascii")

    # ---- counters and connection state -----------------------------------------------------

    @property
    def stats(self) -> StoreStats:
        return self._counter.stats

    @property
    def num_errors(self) -> int:
        """Failed calls (connection lost, timeout) so far."""
        with self._lock:
            return self._num_errors

    @property
    def is_connected(self) -> bool:
        """False from a failed call until the next call that succeeds."""
        with self._lock:
            return self._down_reason is None

    def _may_try(self) -> bool:
        """Up, or down with its backoff deadline passed (then this call is the retry)."""
        with self._lock:
            return self._down_reason is None or time.monotonic() >= self._retry_at

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            self._num_errors += 1
            if self._down_reason is None:
                self._down_reason = f"{exc.__class__.__name__}: {exc}"
                self._backoff_s = self._backoff_initial_s
                warn = True
            else:
                self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
                warn = False
            self._retry_at = time.monotonic() + self._backoff_s
        if warn:  # one warning per outage; the retries stay quiet
            logger.warning(
                "KV store %s: connection lost (%s); lookups are misses and saves are dropped "
                "until it is back (retrying with backoff)",
                self.url,
                exc,
            )

    def _succeeded(self) -> None:
        with self._lock:
            if self._down_reason is None:
                return
            self._down_reason = None
            self._backoff_s = self._backoff_initial_s
            # The server may have restarted empty: forget which blocks it had.
            self._known.clear()
        logger.info("KV store %s: connection back", self.url)

    def _remember(self, key: bytes) -> None:
        with self._lock:
            self._known[key] = None
            self._known.move_to_end(key)
            if len(self._known) > _MAX_KNOWN:
                self._known.popitem(last=False)

    # ---- read ------------------------------------------------------------------------------

    def contains(self, block_hash: BlockHash) -> bool:
        """Seen in Redis by this process (written or read) or queued: a hint, no round trip."""
        key = self.key_of(block_hash)
        with self._lock:
            if key in self._known:
                return True
        return self._saves.is_queued(key)

    def get(self, block_hash: BlockHash) -> bytes | None:
        return self.get_many([block_hash])[0]

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """Validated payloads (None = missing, invalid or unreachable), in one MGET round trip."""
        if not block_hashes:
            return []
        keys = [self.key_of(h) for h in block_hashes]
        if not self._may_try():
            self._count(num_misses=len(keys))
            return [None] * len(keys)
        try:
            # The client is built without decode_responses, so values are raw bytes (or None),
            # never the str the stubs also allow.
            values = cast("list[bytes | None]", self._client.mget(keys))
        except _OUTAGE_ERRORS as exc:
            self._failed(exc)
            self._count(num_misses=len(keys))
            return [None] * len(keys)
        except RedisError as exc:  # a server-side error reply: this call misses, the link is up
            logger.warning("KV store %s: MGET failed (%s); treating it as misses", self.url, exc)
            self._count(num_misses=len(keys))
            return [None] * len(keys)
        self._succeeded()
        out: list[bytes | None] = []
        for block_hash, key, value in zip(block_hashes, keys, values):
            if value is None:
                self._count(num_misses=1)
                out.append(None)
                continue
            try:
                payload = decode_block_checked(self.namespace, block_hash, value)
            except InvalidBlock as exc:
                logger.warning(
                    "KV store %s: %s is invalid (%s); deleted, treated as a miss",
                    self.url,
                    key.decode(),
                    exc,
                )
                self._delete_quietly(key)
                self._count(num_misses=1, num_invalid=1)
                out.append(None)
                continue
            self._remember(key)
            self._count(num_hits=1, bytes_read=len(payload))
            out.append(payload)
        return out

    def _delete_quietly(self, key: bytes) -> None:
        try:
            self._client.delete(key)
        except RedisError as exc:
            logger.debug("KV store %s: cannot delete %r (%s)", self.url, key, exc)
        with self._lock:
            self._known.pop(key, None)

    # ---- write -----------------------------------------------------------------------------

    def put(self, block_hash: BlockHash, payload: bytes) -> None:
        """Queues a save; returns at once. Dropped (and counted) while down or when the queue
        is full."""
        key = self.key_of(block_hash)
        with self._lock:
            if key in self._known:
                return
        if not self._may_try() or not self._saves.offer(key, payload):
            self._count(num_saves_dropped=1)

    def flush(self) -> None:
        """Blocks until every queued save is written (or dropped)."""
        self._saves.flush()

    def close(self) -> None:
        """Flushes, stops the writer thread and closes the connections. Idempotent."""
        self._saves.close()
        self._client.close()

    def _write(self, saves: list[tuple[bytes, bytes]]) -> None:
        """Writer thread: one pipelined round trip of SETs for a batch of (key, payload)."""
        if not self._may_try():
            self._count(num_saves_dropped=len(saves))
            return
        start = time.perf_counter()
        pipe = self._client.pipeline(transaction=False)
        num_bytes = 0
        for key, payload in saves:
            raw_hash = bytes.fromhex(key[len(self.key_prefix) :].decode("ascii"))
            data = encode_block(self.namespace, BlockHash(raw_hash), payload)
            num_bytes += len(data)
            pipe.set(key, data)
        try:
            results = pipe.execute(raise_on_error=False)
        except _OUTAGE_ERRORS as exc:
            self._failed(exc)
            self._count(num_saves_dropped=len(saves))
            return
        self._succeeded()
        num_failed = 0
        for (key, _), result in zip(saves, results):
            if isinstance(result, Exception):  # e.g. OOM under maxmemory-policy noeviction
                num_failed += 1
            else:
                self._remember(key)
        if num_failed:
            logger.warning(
                "KV store %s: %d of %d saves refused (%s)", self.url, num_failed, len(saves),
                next(r for r in results if isinstance(r, Exception)),
            )
        self._count(
            bytes_written=num_bytes,
            num_saves_dropped=num_failed,
            save_s=time.perf_counter() - start,
        )
