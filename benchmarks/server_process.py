"""A server process for a benchmark: started, waited on until /health answers 200, stopped.

Invariant: the process is terminated (killed if it lingers) whatever happens inside the block,
and a server that exits or never turns healthy raises with its log.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from benchmarks.paths import ROOT


@contextlib.contextmanager
def running_server(
    command: list[str],
    port: int,
    env: dict[str, str] | None = None,
    timeout_s: float = 300,
    log_path: Path | None = None,
) -> Iterator[str]:
    """Run `command` (which must listen on `port`) from the repository root; yields its URL.
    log_path: keep the server's output there (otherwise a temporary file, removed)."""
    log = (
        open(log_path, "wb") if log_path is not None
        else tempfile.NamedTemporaryFile("wb", prefix="kvmemo-bench-", suffix=".log", delete=False)
    )
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"{command[:3]} exited:\n{Path(log.name).read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[:3]} not healthy within {timeout_s:.0f} s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        if log_path is None:
            Path(log.name).unlink(missing_ok=True)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
