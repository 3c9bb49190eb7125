"""kvmemo: an LLM inference engine that never computes the same attention keys and values twice.

Public names load lazily so that `import kvmemo.kv` (pure bookkeeping) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvmemo import isa

try:
    isa.apply()  # before anything imports torch: it reads the forced level once, at first use
except isa.IsaError:
    pass  # a bad KVMEMO_ISA is reported where a model loads (load_model): one line, exit 2

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_LOCATIONS = {
    "LLM": "kvmemo.llm",
    "SamplingParams": "kvmemo.sampling",
    "EngineConfig": "kvmemo.config",
    "RequestOutput": "kvmemo.outputs",
    "CompletionOutput": "kvmemo.outputs",
}

if TYPE_CHECKING:
    from kvmemo.config import EngineConfig
    from kvmemo.llm import LLM
    from kvmemo.outputs import CompletionOutput, RequestOutput
    from kvmemo.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LOCATIONS:
        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'kvmemo' has no attribute {name!r}")
