"""Server-test helpers: start a real `kvmemo serve` process on a free port and wait for /health."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

# Everything here needs the `serve` and `test` extras; without them the directory is not collected.
_NEEDED = ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai", "schemathesis")
if any(importlib.util.find_spec(m) is None for m in _NEEDED):
    collect_ignore_glob = ["test_*.py"]

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str | None
    process: subprocess.Popen
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def http(self, **kwargs) -> httpx.Client:
        import httpx

        kwargs.setdefault("timeout", 120)
        return httpx.Client(base_url=self.base_url, headers=self.headers, **kwargs)

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key or "unused",
            max_retries=0,
            timeout=120,
            **kwargs,
        )

    def model_name(self) -> str:
        with self.http() as client:
            return client.get("/v1/models").json()["data"][0]["id"]

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name plus labels, e.g. 'kvmemo_kv_blocks_in_use'."""
        from prometheus_client.parser import text_string_to_metric_families

        with self.http() as client:
            text = client.get("/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch_server(
    *flags: str, api_key: str | None = None, command: str = "serve"
) -> Iterator[RunningServer]:
    """Run `python -m kvmemo.cli serve` (or `command`) with `flags`; kill it on exit."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvmemo.cli",
        command,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    log_file = tempfile.NamedTemporaryFile(
        "wb", prefix="kvmemo-serve-", suffix=".log", delete=False
    )
    import httpx

    process = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT
    )
    server = RunningServer(f"http://127.0.0.1:{port}", api_key, process, Path(log_file.name))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
            try:
                if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"server did not become healthy in {START_TIMEOUT_S} s:\n{server.log()}"
                )
            time.sleep(0.25)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log_file.close()
        os.unlink(log_file.name)
