"""The `kvmemo` command ends without the interpreter's teardown (kvmemo.cli.run), and loses
nothing by it: what it prints arrives, and the KV store holds every block a normal exit writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Long, and answered with one token: the process ends while its blocks are still being saved.
PROMPT = " ".join(f"Stall {i} sold {i % 7} river stones to trader {i % 11}." for i in range(150))


def _stored(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*.kvb"))


def test_fast_exit_prints_and_saves_what_a_normal_exit_does(tmp_path: Path) -> None:
    args = ["generate", PROMPT, "--max-tokens", "1", "--temperature", "0"]
    fast = subprocess.run(
        [sys.executable, "-m", "kvmemo.cli", *args, "--kv-store", f"disk:{tmp_path / 'fast'}"],
        capture_output=True, text=True, timeout=300,
    )
    normal = subprocess.run(
        [sys.executable, "-c",
         "import sys; from kvmemo.cli import main; sys.exit(main(sys.argv[1:]))",
         *args, "--kv-store", f"disk:{tmp_path / 'normal'}"],
        capture_output=True, text=True, timeout=300,
    )
    assert fast.returncode == normal.returncode == 0, fast.stderr + normal.stderr
    assert fast.stdout == normal.stdout and fast.stdout.strip()
    assert _stored(tmp_path / "fast") == _stored(tmp_path / "normal")
    assert _stored(tmp_path / "fast")  # the prompt fills blocks: something was saved


def test_fast_exit_keeps_the_exit_status() -> None:
    bad = subprocess.run([sys.executable, "-m", "kvmemo.cli", "generate", "hi", "--max-tokens",
                          "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error:"), bad.stderr
