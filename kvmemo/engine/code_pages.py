"""Torch's start-up code given back: the code pages its libraries touched once, at import.

Why: importing torch runs libtorch's static initializers (tens of thousands of operator
registrations spread over the whole library), which touches about 60 MB of its code; those pages
stay mapped and counted in the process's RSS, though a decode step runs a few MB of that code.
Given back before the weights load, Gemma 3 270M's peak RSS of one turn fell from 601-609 to
561 MiB (docs/benchmarks.md). MADV_DONTNEED on a private file mapping that was never written only
unmaps its pages (kvmemo/file_pages.py): they stay in the page cache, and code that runs again
faults its page back in from memory (a minor fault, no disk read).

Invariant: only torch's own libraries' executable, read-only private mappings (r-xp), which
nothing writes; never a writable or anonymous mapping, where DONTNEED would discard data.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from kvmemo.file_pages import drop_resident_pages

logger = logging.getLogger(__name__)

TORCH_LIBRARY_DIR = "/torch/lib/"  # libtorch_cpu.so, libtorch_python.so, libc10.so, ...


def torch_code_mappings(maps: str) -> list[tuple[int, int, str]]:
    """(start, end, path) of every r-xp mapping of torch's libraries in /proc/<pid>/maps text."""
    found = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[1] == "r-xp" and TORCH_LIBRARY_DIR in parts[5]:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            found.append((start, end, parts[5].strip()))
    return found


def release_torch_code_pages() -> int:
    """Unmaps the resident pages of torch's code (they fault back in where it runs again);
    returns the bytes of mappings advised, 0 off Linux."""
    if sys.platform != "linux":
        return 0
    advised = 0
    for start, end, path in torch_code_mappings(Path("/proc/self/maps").read_text()):
        if drop_resident_pages(start, end):
            advised += end - start
        else:
            logger.debug("madvise(DONTNEED) refused for %s", path)
    return advised
