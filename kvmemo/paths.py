"""Where kvmemo keeps files it can always rebuild (converted tokenizers, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$KVMEMO_CACHE_DIR, else ~/.cache/kvmemo."""
    configured = os.environ.get("KVMEMO_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "kvmemo"
