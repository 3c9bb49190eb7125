"""The benchmarks are one package imported one way, and the part that peers run needs no kvmemo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A fresh interpreter in which kvmemo and the heavy libraries cannot be imported, as in the
# peers' virtualenvs (llama.cpp's has neither torch nor kvmemo): runners.run and every engine
# runner module must still import, and run's --help must work.
_PEER_LIKE = """
import importlib.abc, runpy, sys

BLOCKED = {"kvmemo", "torch", "numpy", "transformers", "llama_cpp", "vllm", "matplotlib"}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed here")
        return None

sys.meta_path.insert(0, Block())
for module in ("kvmemo_runner", "llamacpp_runner", "vllm_runner", "hf_runner"):
    importlib.import_module(f"benchmarks.runners.engines.{module}")
sys.argv = ["run", "--help"]
runpy.run_module("benchmarks.runners.run", run_name="__main__")
"""


def test_the_run_module_imports_without_kvmemo_or_torch_as_in_a_peer_venv():
    done = subprocess.run([sys.executable, "-c", _PEER_LIKE], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--workload" in done.stdout


def test_no_benchmark_module_edits_sys_path():
    sources = [p for p in (ROOT / "benchmarks").rglob("*.py")
               if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]  # peer venvs
    offenders = [str(p.relative_to(ROOT)) for p in sources if "sys.path" in p.read_text()]
    assert offenders == []
