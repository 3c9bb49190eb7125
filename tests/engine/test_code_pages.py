"""release_torch_code_pages: torch's code pages leave the RSS, and torch runs on unchanged."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmemo.engine.code_pages import torch_code_mappings

MAPS = """\
7f0000000000-7f0000100000 r--p 00000000 08:01 11 /venv/site-packages/torch/lib/libtorch_cpu.so
7f0000100000-7f0000300000 r-xp 00100000 08:01 11 /venv/site-packages/torch/lib/libtorch_cpu.so
7f0000300000-7f0000310000 rw-p 00300000 08:01 11 /venv/site-packages/torch/lib/libtorch_cpu.so
7f0000400000-7f0000500000 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000600000-7f0000700000 rw-p 00000000 00:00 0
7f0000700000-7f0000800000 r-xp 00000000 08:01 13 /venv/torch/lib/libc10 with space.so
"""


def test_only_torch_libraries_executable_private_mappings_are_chosen():
    assert torch_code_mappings(MAPS) == [
        (0x7F0000100000, 0x7F0000300000, "/venv/site-packages/torch/lib/libtorch_cpu.so"),
        (0x7F0000700000, 0x7F0000800000, "/venv/torch/lib/libc10 with space.so"),
    ]


CHILD = r"""
import re, torch
from kvmemo.engine.code_pages import release_torch_code_pages

def torch_code_rss_kib():
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            fields = line.split()
            inside = fields[1] == "r-xp" and len(fields) > 5 and "/torch/lib/" in fields[5]
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total

before = torch_code_rss_kib()
advised = release_torch_code_pages()
after = torch_code_rss_kib()
x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
product = (x @ x.T).tolist()
print(before, after, advised, product)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc are Linux's")
def test_torch_code_leaves_the_rss_and_torch_still_computes():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          check=True, timeout=120)
    before, after, advised, product = done.stdout.strip().split(" ", 3)
    assert int(advised) > 0
    assert int(before) > 10 * 1024  # importing torch touched more than 10 MiB of its code
    assert int(after) < int(before) // 2
    assert product == str([[14.0, 38.0, 62.0], [38.0, 126.0, 214.0], [62.0, 214.0, 366.0]])
