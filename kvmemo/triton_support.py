"""Whether the Triton kernels can run here, answered without importing triton (slow to import)."""

from __future__ import annotations

import importlib.util
import os

import torch

# What the Triton GEMM and attention kernels compute in (fp8 pages are read as raw bytes).
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels on CPU tensors in NumPy (how CI tests them).
    Triton reads it when a kernel is defined, so it must be set before the kernels' import."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    kind = torch.device(device).type
    if kind == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is available"
    if kind == "cpu" and interpreting():
        return None
    return f"Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1; got device {kind!r}"
