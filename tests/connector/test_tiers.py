"""Tiers: the kv_store list (spec parsing, EngineConfig, CLI) and TieredStore over disk + Redis."""

from __future__ import annotations

import pytest

from kvmemo.cli import build_parser
from kvmemo.config import EngineConfig
from kvmemo.connector.spec import DEFAULT_REDIS_TIMEOUT_S, parse_kv_store, parse_kv_stores
from tests.connector.conftest import block_hash, payload


def test_parse_tier_list_in_order():
    specs = parse_kv_stores(["disk:/d?capacity=1GiB", "redis://10.0.0.5:6380/2?timeout=0.25"])
    assert [(s.kind, s.path) for s in specs] == [("disk", "/d"), ("redis", "redis://10.0.0.5:6380/2")]
    assert specs[0].capacity_bytes == 2**30 and specs[0].timeout_s is None
    assert specs[1].timeout_s == 0.25 and specs[1].capacity_bytes is None
    assert parse_kv_stores("redis://h") == (parse_kv_store("redis://h"),)
    assert parse_kv_store("redis://h:6379/0").timeout_s == DEFAULT_REDIS_TIMEOUT_S


@pytest.mark.parametrize(
    "value, message",
    [
        ([], "non-empty list"),
        (["disk:/a", 3], "must be a string"),
        (["disk:/a", "disk:/a?capacity=1GiB"], "twice"),
        ("redis://", "redis://host:6379/0"),
        ("redis://h:6379/x", "redis://host:6379/0"),
        ("redis://h:99999/0", "port"),
        ("redis://h/0?timeout=0", "timeout"),
        ("redis://h/0?timeout=soon", "timeout"),
        ("redis://h/0?capacity=1GiB", "unknown for redis"),
        ("disk:/x?timeout=1", "unknown for disk"),
    ],
)
def test_bad_tier_lists_name_kv_store(value, message):
    with pytest.raises(ValueError, match="kv_store") as info:
        parse_kv_stores(value)
    assert message in str(info.value)


def test_engine_config_takes_a_string_or_a_list():
    assert EngineConfig(kv_store="disk:/a").kv_store == "disk:/a"
    config = EngineConfig.from_kwargs(kv_store=["disk:/a", "redis://h:6379/0"])
    assert config.kv_store == ("disk:/a", "redis://h:6379/0")
    hash(config)  # frozen configs stay hashable
    with pytest.raises(ValueError, match="kv_store"):
        EngineConfig.from_kwargs(kv_store=["disk:/a", "ftp://x"])
    with pytest.raises(ValueError, match="kv_store"):
        EngineConfig.from_kwargs(kv_store=[])
    with pytest.raises(ValueError, match="tuple"):  # frozen: the constructor never converts
        EngineConfig(kv_store=["disk:/a"])


def test_cli_kv_store_is_repeatable():
    args = build_parser().parse_args(
        ["serve", "--kv-store", "disk:/p", "--kv-store", "redis://127.0.0.1:6379/0"]
    )
    assert args.kv_store == ["disk:/p", "redis://127.0.0.1:6379/0"]
    assert build_parser().parse_args(["serve"]).kv_store is None


@pytest.fixture
def disk_and_redis(tmp_path, namespace):
    pytest.importorskip("redis")
    from kvmemo.connector.disk import DiskStore
    from kvmemo.connector.redis_store import RedisStore
    from kvmemo.connector.tiered import TieredStore
    from tests.redis_server import RedisServer

    with RedisServer() as server:
        disk = DiskStore(tmp_path, 2**30, namespace)
        remote = RedisStore(server.url, namespace)
        tiered = TieredStore([("disk", disk), ("redis", remote)])
        try:
            yield tiered, disk, remote
        finally:
            tiered.close()


def test_lookup_falls_through_tiers_and_promotes(disk_and_redis, namespace):
    tiered, disk, remote = disk_and_redis
    # Blocks 0-1 on disk, 0-3 in Redis (another replica saved them), 4 nowhere, 5 in Redis.
    for i in range(4):
        remote.put(block_hash(i), payload(namespace, i))
    remote.put(block_hash(5), payload(namespace, 5))
    for i in range(2):
        disk.put(block_hash(i), payload(namespace, i))
    tiered.flush()
    got = tiered.get_many([block_hash(i) for i in range(6)])
    assert got[:4] == [payload(namespace, i) for i in range(4)]
    assert got[4:] == [None, None]  # a block after a miss is no use to a prefix
    served = {t.name: t.served_blocks for t in tiered.tier_stats()}
    assert served == {"disk": 2, "redis": 2}
    tiered.flush()
    assert disk.get(block_hash(2)) == payload(namespace, 2)  # promoted to the faster tier
    assert disk.get(block_hash(5)) is None
    tiered.get_many([block_hash(i) for i in range(4)])
    assert {t.name: t.served_blocks for t in tiered.tier_stats()} == {"disk": 6, "redis": 2}


def test_put_saves_to_every_tier(disk_and_redis, namespace):
    tiered, disk, remote = disk_and_redis
    assert not tiered.contains(block_hash(9))
    tiered.put(block_hash(9), payload(namespace, 9))
    tiered.flush()
    assert disk.get(block_hash(9)) == payload(namespace, 9)
    assert remote.get(block_hash(9)) == payload(namespace, 9)
    assert tiered.contains(block_hash(9))
    assert tiered.stats.num_hits == 2
