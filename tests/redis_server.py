"""A real `redis-server` on a free loopback port for tests: start, stop (kill) and restart it.

Tests that need it call require_redis_server() first: it skips with a clear reason only when the
binary is truly absent (CI installs it, see .ci/run).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return path


class RedisServer:
    """One redis-server process, no persistence, allkeys-lru under maxmemory."""

    def __init__(self, maxmemory: str = "512mb") -> None:
        self.binary = require_redis_server()
        self.port = free_port()
        self.maxmemory = maxmemory
        self.dir = tempfile.mkdtemp(prefix="kvmemo-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.process is None, "already running"
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Kills the server (SIGKILL: no shutdown handshake, as in a crash); data is lost."""
        if self.process is None:
            return
        self.process.kill()
        self.process.wait(timeout=10)
        self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

