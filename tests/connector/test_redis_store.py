"""RedisStore against a real redis-server: round trip, corrupt values, namespaces, batches,
LRU eviction and a lost connection."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest

pytest.importorskip("redis")

from kvmemo.connector.redis_store import RedisStore  # noqa: E402
from kvmemo.connector.store import encode_block  # noqa: E402
from tests.connector.conftest import block_hash, payload  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


@pytest.fixture(scope="module")
def server():
    with RedisServer() as running:
        yield running


@pytest.fixture
def store(server, namespace):
    server.client().flushall()
    s = RedisStore(server.url, namespace, timeout_s=0.5)
    yield s
    s.close()


def test_round_trip_and_misses(store, namespace):
    assert store.get(block_hash(0)) is None
    for i in range(3):
        store.put(block_hash(i), payload(namespace, i))
    store.flush()
    for i in range(3):
        assert store.get(block_hash(i)) == payload(namespace, i)
        assert store.contains(block_hash(i))
    stats = store.stats
    assert (stats.num_hits, stats.num_misses, stats.num_invalid) == (3, 1, 0)
    assert stats.bytes_read == 3 * namespace.payload_bytes


def test_values_are_the_checksummed_block_encoding(store, server, namespace):
    store.put(block_hash(7), payload(namespace, 7))
    store.flush()
    raw = server.client().get(store.key_of(block_hash(7)))
    assert raw == encode_block(namespace, block_hash(7), payload(namespace, 7))
    assert namespace.dir_name in store.key_of(block_hash(7)).decode()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda data: data[:-1],  # truncated
        lambda data: data[:-1] + bytes([data[-1] ^ 1]),  # one bit flipped in the payload
        lambda data: b"not a block at all",
    ],
)
def test_corrupt_value_is_a_logged_miss_and_deleted(store, server, namespace, caplog, corrupt):
    h = block_hash(1)
    good = encode_block(namespace, h, payload(namespace, 1))
    client = server.client()
    client.set(store.key_of(h), corrupt(good))
    with caplog.at_level(logging.WARNING, logger="kvmemo.connector.redis_store"):
        assert store.get(h) is None
    assert "invalid" in caplog.text
    assert store.stats.num_invalid == 1
    assert client.get(store.key_of(h)) is None  # removed, so the next save can replace it


def test_a_block_stored_under_another_hash_is_a_miss(store, server, namespace):
    # The right bytes under the wrong key (e.g. a copy bug) must not be served.
    client = server.client()
    client.set(store.key_of(block_hash(2)), encode_block(namespace, block_hash(3), payload(namespace, 3)))
    assert store.get(block_hash(2)) is None


def test_namespace_isolation(store, server, namespace):
    other_ns = replace(namespace, root_hash=bytes(32))  # another model: same block hashes
    other = RedisStore(server.url, other_ns)
    try:
        store.put(block_hash(0), payload(namespace, 0))
        store.flush()
        assert other.get(block_hash(0)) is None
        assert store.key_of(block_hash(0)) != other.key_of(block_hash(0))
        # Even a value copied across namespaces is refused by the header check.
        server.client().set(other.key_of(block_hash(0)), server.client().get(store.key_of(block_hash(0))))
        assert other.get(block_hash(0)) is None
        assert other.stats.num_invalid == 1
    finally:
        other.close()


def test_get_many_in_order_with_gaps(store, namespace):
    for i in (0, 1, 3):
        store.put(block_hash(i), payload(namespace, i))
    store.flush()
    got = store.get_many([block_hash(i) for i in range(5)])
    assert got == [payload(namespace, 0), payload(namespace, 1), None, payload(namespace, 3), None]
    assert store.get_many([]) == []


def test_allkeys_lru_evicts_old_blocks_and_saving_goes_on(namespace):
    with RedisServer(maxmemory="2mb") as small:
        store = RedisStore(small.url, namespace)
        try:
            n = 4000  # ~4 MB of 1 KiB blocks: twice maxmemory
            for i in range(n):
                store.put(block_hash(i), payload(namespace, i))
                if i % 500 == 0:
                    store.flush()
            store.flush()
            assert store.stats.num_saves_dropped == 0  # LRU makes room; nothing is refused
            got = store.get_many([block_hash(i) for i in range(n)])
            num_present = sum(p is not None for p in got)
            assert 0 < num_present < n // 2  # evicted down to what 2 MB holds
            assert all(p is None or p == payload(namespace, i) for i, p in enumerate(got))
            # Redis's LRU clock ticks once a second: a block saved after a tick is the newest.
            time.sleep(1.1)
            store.put(block_hash(n), payload(namespace, n))
            store.flush()
            assert store.get(block_hash(n)) == payload(namespace, n)
        finally:
            store.close()


def test_lost_connection_is_misses_one_warning_and_recovers(namespace, caplog):
    with RedisServer() as srv:
        store = RedisStore(srv.url, namespace, timeout_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.2)
        try:
            store.put(block_hash(0), payload(namespace, 0))
            store.flush()
            srv.stop()
            with caplog.at_level(logging.WARNING, logger="kvmemo.connector.redis_store"):
                for _ in range(20):
                    start = time.monotonic()
                    assert store.get_many([block_hash(0), block_hash(1)]) == [None, None]
                    assert time.monotonic() - start < 1.0  # bounded by the socket timeout
                    store.put(block_hash(2), payload(namespace, 2))  # dropped, never raises
                    time.sleep(0.02)
                store.flush()
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]
            assert "connection lost" in warnings[0].getMessage()
            assert not store.is_connected and store.num_errors >= 2
            srv.start()  # same port, empty (no persistence)
            deadline = time.monotonic() + 10
            while store.get(block_hash(3)) is None and not store.is_connected:
                assert time.monotonic() < deadline, "never reconnected"
                time.sleep(0.05)
            # Saves work again, including a block that was known before the outage.
            store.put(block_hash(0), payload(namespace, 0))
            store.flush()
            assert store.get(block_hash(0)) == payload(namespace, 0)
        finally:
            store.close()
