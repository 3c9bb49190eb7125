"""`kvmemo serve` stops on SIGTERM (docker stop, systemd, Ctrl-C) whichever of its threads the
kernel hands the signal to: the engine steps on the main thread, where Python runs signal
handlers, and an idle engine used to wait there untimed, so a signal delivered to the HTTP
thread went unseen until the next request came."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.server.conftest import launch_server

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux")]

_SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


def _another_thread(pid: int) -> int:
    """A thread of the process other than its main one (the newest: Python does not name its
    threads for the kernel)."""
    others = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()
              if int(task.name) != pid]
    assert others, f"process {pid} has one thread"
    return max(others)


@pytest.mark.skipif(_SYS_TGKILL is None, reason="tgkill's number is known for x86-64 and arm64")
def test_sigterm_to_another_thread_stops_an_idle_server():
    with launch_server("--num-blocks", "64", "--max-model-len", "512") as server:
        with server.http() as http:  # one request first: the AnyIO worker exists too
            assert http.post("/v1/completions", json={"model": server.model_name(),
                             "prompt": "Hi", "max_tokens": 2}).status_code == 200
        pid = server.process.pid
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(_SYS_TGKILL, pid, _another_thread(pid),
                            signal.SIGTERM) == 0
        try:
            server.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not stop within 5 s of SIGTERM")
