"""The house rule, executable: kvmemo.kv never imports torch."""

from __future__ import annotations

import subprocess
import sys

_CODE = """
import sys
import kvmemo.kv, kvmemo.kv.manager, kvmemo.kv.block_pool, kvmemo.kv.hashing
import kvmemo.kv.events, kvmemo.kv.free_queue, kvmemo.kv.partial_index, kvmemo.kv.hybrid
import kvmemo.kv.layout, kvmemo.kv.match
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "kvmemo.engine",
             "kvmemo.model", "kvmemo.attention")))
assert not bad, bad
"""


def test_kv_imports_no_torch_model_or_engine() -> None:
    result = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
