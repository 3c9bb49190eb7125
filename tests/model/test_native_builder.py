"""kvmemo.native builds a kernel per source, local headers, flags and CPU: a changed header is a
new build (not a stale cached one), and `march` builds for another target beside the native one."""

from __future__ import annotations

import ctypes
import platform
import shutil

import pytest

from kvmemo.native import load_library

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")


def _value(library: ctypes.CDLL | None) -> int:
    assert library is not None
    library.answer.restype = ctypes.c_int
    return int(library.answer())


def test_a_changed_local_header_rebuilds_the_kernel(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVMEMO_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "k.c"
    source.write_text('#include "k.h"\nint answer(void) { return VALUE; }\n')
    (tmp_path / "k.h").write_text("#define VALUE 41\n")
    assert _value(load_library(source, "test")) == 41
    (tmp_path / "k.h").write_text("#define VALUE 42\n")  # the .c file is unchanged
    assert _value(load_library(source, "test")) == 42
    built = sorted(p.name for p in (tmp_path / "cache" / "kernels").glob("k-*.so"))
    assert len(built) == 2
    if platform.machine() == "x86_64":  # another target: its own build beside the native one
        # (x86-64-v2: a target none of KVMEMO_ISA's levels builds, so it is "another" under each)
        assert _value(load_library(source, "test", march="x86-64-v2")) == 42
        assert len(list((tmp_path / "cache" / "kernels").glob("k-*.so"))) == 3


def test_a_build_is_reused_and_a_broken_cache_entry_is_rebuilt(tmp_path, monkeypatch) -> None:
    source = tmp_path / "k.c"
    source.write_text("int answer(void) { return 7; }\n")
    monkeypatch.setenv("KVMEMO_CACHE_DIR", str(tmp_path / "a"))
    assert _value(load_library(source, "test")) == 7
    (first,) = (tmp_path / "a" / "kernels").glob("k-*.so")
    built_at = first.stat().st_mtime_ns
    assert _value(load_library(source, "test")) == 7
    assert first.stat().st_mtime_ns == built_at  # reused, not rebuilt
    # A damaged entry under the same name in another cache dir (never overwrite a loaded
    # library in place: the process maps it).
    broken = tmp_path / "b" / "kernels" / first.name
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not an ELF file")
    monkeypatch.setenv("KVMEMO_CACHE_DIR", str(tmp_path / "b"))
    assert _value(load_library(source, "test")) == 7
    assert broken.read_bytes()[:4] == b"\x7fELF"  # rebuilt
