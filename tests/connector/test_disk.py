"""DiskStore on real files in tmp_path: layout, restart, corrupt files, concurrent writers,
capacity (LRU) and write failures.

Tests run as root in CI, where chmod 0o555 does not stop writes; a read-only or full disk is
simulated by monkeypatching os.replace / os.write in kvmemo.connector.disk to raise the error
the kernel would raise (PermissionError, OSError(ENOSPC)).
"""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest

from kvmemo.connector import disk as disk_module
from kvmemo.connector.disk import DiskStore
from kvmemo.connector.store import decode_block_checked, encode_block
from tests.connector.conftest import block_hash, payload

MiB = 2**20


def _store(tmp_path, namespace, **kw) -> DiskStore:
    kw.setdefault("capacity_bytes", 64 * MiB)
    return DiskStore(tmp_path, namespace=namespace, **kw)


def test_put_get_layout_and_restart(tmp_path, namespace):
    store = _store(tmp_path, namespace)
    for i in range(3):
        store.put(block_hash(i), payload(namespace, i))
    store.flush()
    hex0 = block_hash(0).hex()
    path = tmp_path / namespace.dir_name / hex0[:2] / f"{hex0}.kvb"
    assert path.is_file() and store.path_of(block_hash(0)) == path
    assert store.get(block_hash(1)) == payload(namespace, 1)
    assert store.get(block_hash(99)) is None
    assert store.stats.num_hits == 1 and store.stats.num_misses == 1
    store.close()
    again = _store(tmp_path, namespace)  # a restart: the index comes from the directory
    assert again.num_blocks == 3 and again.contains(block_hash(2))
    assert again.total_bytes == sum(
        p.stat().st_size for p in (tmp_path / namespace.dir_name).rglob("*.kvb")
    )
    assert again.get(block_hash(2)) == payload(namespace, 2)


def test_put_skips_blocks_already_stored(tmp_path, namespace):
    store = _store(tmp_path, namespace)
    store.put(block_hash(0), payload(namespace, 0))
    store.flush()
    written = store.stats.bytes_written
    store.put(block_hash(0), payload(namespace, 0))
    store.flush()
    assert store.stats.bytes_written == written


def _corrupt_truncate(path, namespace, other):
    path.write_bytes(path.read_bytes()[:-100])


def _corrupt_flip(path, namespace, other):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _corrupt_empty(path, namespace, other):
    path.write_bytes(b"")


def _corrupt_foreign(path, namespace, other):
    # A valid file of another namespace, copied under this namespace's path.
    path.write_bytes(encode_block(other, block_hash(0), payload(other, 0)))


@pytest.mark.parametrize(
    "corrupt", [_corrupt_truncate, _corrupt_flip, _corrupt_empty, _corrupt_foreign]
)
def test_corrupt_file_is_a_logged_miss_and_removed(tmp_path, namespace, caplog, corrupt):
    import dataclasses

    store = _store(tmp_path, namespace)
    store.put(block_hash(0), payload(namespace, 0))
    store.flush()
    path = store.path_of(block_hash(0))
    other = dataclasses.replace(namespace, root_hash=b"\x07" * 32)
    corrupt(path, namespace, other)
    with caplog.at_level(logging.WARNING, logger="kvmemo.connector.disk"):
        assert store.get(block_hash(0)) is None
    assert "invalid" in caplog.text
    assert not path.exists() and not store.contains(block_hash(0))
    assert store.stats.num_invalid == 1
    store.put(block_hash(0), payload(namespace, 0))  # saved again on the next commit
    store.flush()
    assert store.get(block_hash(0)) == payload(namespace, 0)


def test_directory_where_a_file_should_be(tmp_path, namespace, caplog):
    store = _store(tmp_path, namespace)
    path = store.path_of(block_hash(0))
    path.mkdir(parents=True)
    (path / "keep").write_text("someone else's")  # never deleted
    with caplog.at_level(logging.WARNING, logger="kvmemo.connector.disk"):
        assert store.get(block_hash(0)) is None
    assert "is a directory" in caplog.text
    assert (path / "keep").exists()
    empty = store.path_of(block_hash(1))
    empty.mkdir(parents=True)
    assert store.get(block_hash(1)) is None
    assert not empty.exists()  # an empty stray directory is removed
    restarted = _store(tmp_path, namespace)  # the scan skips directories
    assert not restarted.contains(block_hash(0))


def test_concurrent_writers_leave_only_valid_files(tmp_path, namespace):
    stores = [_store(tmp_path, namespace) for _ in range(4)]
    barrier = threading.Barrier(len(stores))

    def write(store: DiskStore) -> None:
        barrier.wait()
        for i in range(40):
            store.put(block_hash(i), payload(namespace, i))
        store.flush()

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    files = sorted((tmp_path / namespace.dir_name).rglob("*"))
    kvb = [p for p in files if p.is_file()]
    assert len(kvb) == 40 and all(p.suffix == ".kvb" for p in kvb)  # no temp files left
    for p in kvb:
        decode_block_checked(namespace, block_hash_of(p), p.read_bytes())


def block_hash_of(path):
    return bytes.fromhex(path.name.removesuffix(".kvb"))


def test_capacity_evicts_least_recently_used(tmp_path, namespace):
    file_bytes = len(encode_block(namespace, block_hash(0), payload(namespace, 0)))
    capacity = 10 * file_bytes
    store = _store(tmp_path, namespace, capacity_bytes=capacity)
    for i in range(10):
        store.put(block_hash(i), payload(namespace, i))
    store.flush()
    assert store.get(block_hash(0)) is not None  # block 0 becomes the most recently used
    for i in range(10, 40):
        store.put(block_hash(i), payload(namespace, i))
        store.flush()
        if i % 5 == 0:
            assert store.get(block_hash(0)) is not None
    on_disk = sum(p.stat().st_size for p in (tmp_path / namespace.dir_name).rglob("*.kvb"))
    assert on_disk <= capacity and store.total_bytes == on_disk
    assert store.stats.num_evicted == 30
    survivors = {i for i in range(40) if store.path_of(block_hash(i)).exists()}
    assert 0 in survivors and set(range(31, 40)) <= survivors
    assert not any(i in survivors for i in range(1, 25))
    restarted = _store(tmp_path, namespace, capacity_bytes=capacity)
    restarted.put(block_hash(40), payload(namespace, 40))  # LRU order survives via mtime
    restarted.flush()
    assert restarted.total_bytes <= capacity


def test_aged_arc_eviction_favours_a_block_read_before(tmp_path, namespace):
    """eviction=aged-arc: block R is read, evicted and written again (its ghost says reads were
    evicted too early, so read blocks' ages now count 1% less); R then outlives F, an unread
    block written one tick after it, where LRU evicts R."""
    file_bytes = len(encode_block(namespace, block_hash(0), payload(namespace, 0)))
    R, A, B, C, F, G = range(6)
    survivors = {}
    for eviction in ("lru", "aged-arc"):
        store = _store(tmp_path / eviction, namespace, capacity_bytes=3 * file_bytes,
                       eviction=eviction)

        def write(i):
            store.put(block_hash(i), payload(namespace, i))
            store.flush()

        def on_disk():
            return {i for i in range(6) if store.path_of(block_hash(i)).exists()}

        write(R)
        assert store.get(block_hash(R)) is not None
        for i in (A, B, C):
            write(i)
        assert on_disk() == {A, B, C}  # R was the oldest under both
        write(R)
        write(F)
        assert on_disk() == {C, R, F}
        for _ in range(112):  # C is read: R and F become the two oldest, F one tick newer
            assert store.get(block_hash(C)) is not None
        write(G)
        survivors[eviction] = on_disk()
    assert survivors == {"lru": {C, F, G}, "aged-arc": {C, R, G}}


def test_permission_denied_pauses_saving_with_one_warning(tmp_path, namespace, caplog, monkeypatch):
    store = _store(tmp_path, namespace)
    store.put(block_hash(0), payload(namespace, 0))
    store.flush()

    def deny(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", str(dst))

    monkeypatch.setattr(disk_module.os, "replace", deny)
    with caplog.at_level(logging.WARNING, logger="kvmemo.connector.disk"):
        for i in range(1, 6):
            store.put(block_hash(i), payload(namespace, i))
        store.flush()
    warnings = [r for r in caplog.records if "saving paused" in r.getMessage()]
    assert len(warnings) == 1 and store.is_saving_paused
    assert store.stats.num_saves_dropped == 5
    assert store.get(block_hash(0)) == payload(namespace, 0)  # reading goes on
    assert not [p for p in (tmp_path / namespace.dir_name).rglob("*") if p.name.endswith(".tmp")]


def test_disk_full_pauses_saving(tmp_path, namespace, caplog, monkeypatch):
    store = _store(tmp_path, namespace)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module.os, "write", full)
    with caplog.at_level(logging.WARNING, logger="kvmemo.connector.disk"):
        store.put(block_hash(0), payload(namespace, 0))
        store.put(block_hash(1), payload(namespace, 1))
        store.flush()
    assert sum("saving paused" in r.getMessage() for r in caplog.records) == 1
    assert store.get(block_hash(0)) is None


def test_full_queue_drops_instead_of_blocking(tmp_path, namespace, monkeypatch):
    release = threading.Event()
    real_encode = disk_module.encode_block

    def slow_encode(*args):
        release.wait(10)
        return real_encode(*args)

    monkeypatch.setattr(disk_module, "encode_block", slow_encode)
    store = _store(tmp_path, namespace, max_queue_bytes=2 * namespace.payload_bytes)  # 2 slots
    for i in range(10):
        store.put(block_hash(i), payload(namespace, i))  # must return at once
    release.set()
    store.flush()
    stats = store.stats
    assert stats.num_saves_dropped >= 7
    assert store.num_blocks == 10 - stats.num_saves_dropped


def test_stale_temp_files_are_cleaned_at_startup(tmp_path, namespace):
    store = _store(tmp_path, namespace)
    stale = store.path_of(block_hash(0)).with_name(".x.123.abc.tmp")
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"partial")
    os.utime(stale, (1, 1))
    fresh = stale.with_name(".y.123.abc.tmp")
    fresh.write_bytes(b"being written by a live process")
    _store(tmp_path, namespace)
    assert not stale.exists() and fresh.exists()


def test_store_modules_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, kvmemo.connector.disk, kvmemo.connector.spec, kvmemo.connector.base; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_uncreatable_directory_is_a_value_error(tmp_path, namespace):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="kv_store directory"):
        DiskStore(blocker / "store", 2**20, namespace)


def test_queued_saves_are_written_at_interpreter_exit(tmp_path):
    import subprocess
    import sys

    code = f"""
import hashlib
from kvmemo.connector.disk import DiskStore
from kvmemo.connector.store import StoreNamespace
ns = StoreNamespace(root_hash=b"r" * 32, model_name="m", dtype="float32",
                    block_shape=(2, 2, 4, 2, 8), itemsize=4)
store = DiskStore({str(tmp_path)!r}, 2**30, ns)
for i in range(20):
    store.put(hashlib.sha256(bytes([i])).digest(), bytes([i]) * ns.payload_bytes)
"""  # exits without flush()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert len(list(tmp_path.rglob("*.kvb"))) == 20
