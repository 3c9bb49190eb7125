"""The weights fingerprint is the hash of every byte, remembered or not: a remembered value is
only returned for the very files it was computed from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvmemo.model.loading.fingerprint import fingerprint_files, hash_files, memo_path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVMEMO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _weights(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    return path


def test_remembered_equals_hashed(tmp_path: Path, cache: Path) -> None:
    path = _weights(tmp_path, b"weights " * 1000)
    first = fingerprint_files([path], tmp_path)
    assert memo_path([path], tmp_path).is_file()
    assert fingerprint_files([path], tmp_path) == first == hash_files([path], tmp_path)


def test_a_rewritten_file_is_hashed_again(tmp_path: Path, cache: Path) -> None:
    """Same size, modification time set back: the status-change time still tells."""
    path = _weights(tmp_path, b"a" * 4096)
    before = fingerprint_files([path], tmp_path)
    stat = path.stat()
    with open(path, "r+b") as f:
        f.write(b"b")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = fingerprint_files([path], tmp_path)
    assert after != before
    assert after == hash_files([path], tmp_path)


def test_a_damaged_memo_is_a_miss(tmp_path: Path, cache: Path) -> None:
    path = _weights(tmp_path, b"c" * 100)
    expected = hash_files([path], tmp_path)
    memo = memo_path([path], tmp_path)
    memo.parent.mkdir(parents=True)
    memo.write_text("not a digest")
    assert fingerprint_files([path], tmp_path) == expected
    assert memo.read_text().strip() == expected  # and rewritten
