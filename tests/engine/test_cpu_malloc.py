"""keep_freed_memory: glibc's thresholds raised once at CPU engine start, never over the user's."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from kvmemo.engine.cpu_malloc import (
    M_MMAP_THRESHOLD,
    M_TOP_PAD,
    M_TRIM_THRESHOLD,
    keep_freed_memory,
)


class FakeLibc:
    def __init__(self, accept: bool = True) -> None:
        self.calls: list[tuple[int, int]] = []
        self.accept = accept

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1 if self.accept else 0


def test_sets_mmap_trim_and_top_pad_thresholds():
    libc = FakeLibc()
    assert keep_freed_memory(libc, environ={})
    assert dict(libc.calls) == {M_MMAP_THRESHOLD: 32 * 2**20, M_TRIM_THRESHOLD: 2**30, M_TOP_PAD: 64 * 2**20}


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"},
        {"LD_PRELOAD": "libjemalloc.so.2"},
    ],
    ids=["trim env", "mmap env", "tunables", "tcmalloc", "jemalloc"],
)
def test_leaves_a_user_tuned_or_replaced_allocator_alone(environ):
    libc = FakeLibc()
    assert not keep_freed_memory(libc, environ=environ)
    assert libc.calls == []


def test_a_refused_value_is_reported_not_raised():
    assert not keep_freed_memory(FakeLibc(accept=False), environ={})


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="needs glibc")
def test_real_glibc_accepts_the_thresholds():
    # In a child process: the thresholds are process-wide and this one should stay as it was.
    code = "from kvmemo.engine.cpu_malloc import keep_freed_memory; print(keep_freed_memory(environ={}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "True", result.stderr
