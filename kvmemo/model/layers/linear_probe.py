"""Which linear kernel is fastest here: measured once per machine, cached on disk.

Invariant: the choice is keyed by everything that changes the answer (CPU model and flags, torch
version, dtype, thread count, the model's weight shapes); a missing, corrupt or foreign cache file
means the probe runs again and rewrites it (atomically), never an error. KVMEMO_LINEAR_KERNEL
forces one kernel for both classes (torch, onednn, skinny, which serves decode only, or triton).
On a GPU nothing is probed: the Triton GEMM (batch-invariant), or torch's without triton.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvmemo import isa
from kvmemo.model.layers.linear import (
    CPU_KERNELS,
    DECODE_ROWS,
    KERNELS,
    KernelChoice,
    Linear,
    kernel_usable,
)
from kvmemo.paths import cache_root
from kvmemo.triton_support import TRITON_DTYPES

logger = logging.getLogger(__name__)

# 2: the skinny kernel became a packed GEMM serving bf16 too (choices cached before are stale)
# 3: the decode class grew to 128 rows
CACHE_VERSION = 3
DECODE_PROBE_ROWS = (1, 16, 64)  # a single stream and batches of decodes
PREFILL_PROBE_ROWS = 512  # a prefill chunk


# What a kernel needs that a CPU may lack, for the error a forced kernel gets where it cannot run.
_NEEDS = {
    ("onednn", torch.bfloat16): " (oneDNN's bf16 needs avx512bw, avx512vl and avx512dq, or "
                                "avx_ne_convert)",
    ("skinny", torch.bfloat16): " (needs a C compiler)",
    ("skinny", torch.float32): " (needs a C compiler)",
    **{("triton", dtype): " (needs triton, and on a CPU TRITON_INTERPRET=1)"
       for dtype in TRITON_DTYPES},
}


def cache_path() -> Path:
    return cache_root() / "linear-kernels.json"


def choose_kernels(weights: Sequence[torch.Tensor], device: torch.device) -> KernelChoice:
    """The fastest usable kernel per shape class for the model's layer weights ([N, K] each,
    one dtype): decode is timed on the weights themselves (a decode step streams all of them
    from memory, so a probe on a few cached matrices would favour another kernel), prefill on
    one matrix of each shape."""
    dtype = weights[0].dtype
    shapes = [(w.shape[0], w.shape[1]) for w in weights]
    forced = os.environ.get("KVMEMO_LINEAR_KERNEL")
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"KVMEMO_LINEAR_KERNEL must be one of {list(KERNELS)}, got {forced!r}")
        if device.type == "cpu" and not kernel_usable(forced, dtype, device):
            usable = [name for name in CPU_KERNELS if kernel_usable(name, dtype, device)]
            raise ValueError(
                f"KVMEMO_LINEAR_KERNEL={forced} cannot compute {str(dtype).removeprefix('torch.')}"
                f" on this CPU at the {isa.active()} instruction-set level"
                f"{_NEEDS.get((forced, dtype), '')}; allowed here: {', '.join(usable)}"
            )
        return KernelChoice(decode=forced, prefill="torch" if forced == "skinny" else forced)
    if device.type != "cpu":  # a GPU: the batch-invariant Triton GEMM where triton runs
        gpu_gemm = kernel_usable("triton", dtype, device)
        return KernelChoice("triton", "triton") if gpu_gemm else KernelChoice()
    key = _key(shapes, dtype)
    entries = _read_cache()
    entry = entries.get(key)
    if isinstance(entry, dict):
        try:
            return KernelChoice(decode=entry["decode"], prefill=entry["prefill"])
        except (KeyError, TypeError, ValueError):
            logger.warning("ignoring a malformed linear-kernel cache entry; probing again")
    start = time.perf_counter()
    choice, timings = _measure(weights)
    entries[key] = {"decode": choice.decode, "prefill": choice.prefill, "timings_ms": timings}
    _write_cache(entries)
    logger.info(
        "linear kernels for %s (probed in %.1f s, cached in %s): decode %s, prefill %s; %s",
        str(dtype).removeprefix("torch."), time.perf_counter() - start, cache_path(),
        choice.decode, choice.prefill, timings,
    )
    return choice


def _key(shapes: Sequence[tuple[int, int]], dtype: torch.dtype) -> str:
    digest = hashlib.sha256()
    for part in (_cpu_identity(), torch.__version__, str(dtype), str(torch.get_num_threads()),
                 repr(sorted(set(shapes)))):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def _cpu_identity() -> str:
    """Model name, family/model numbers and feature flags, and the active instruction-set level
    (a forced level is another machine): the VM names different CPUs alike."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "cpu family", "model\t", "flags", "Features", "CPU part")
    seen: dict[str, str] = {}
    for line in lines:
        for name in wanted:
            if line.startswith(name) and name not in seen:
                seen[name] = line
    return "\n".join([*seen.values(), f"isa {isa.active()}"]) or platform.machine()


def _read_cache() -> dict:
    path = cache_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("unreadable linear-kernel cache %s (%s): probing again", path, e)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _write_cache(entries: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1)
        os.replace(f.name, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as e:  # a read-only home: probe again next start, serve now
        logger.warning("could not cache the linear-kernel choice in %s: %s", path, e)


def _measure(weights: Sequence[torch.Tensor]) -> tuple[KernelChoice, dict[str, float]]:
    """Times every usable kernel per class; the fastest total wins."""
    cpu = torch.device("cpu")
    dtype = weights[0].dtype
    one_per_shape = list({(w.shape[0], w.shape[1]): w for w in weights}.values())
    timings: dict[str, float] = {}
    best: dict[str, tuple[float, str]] = {}
    classes = {"decode": DECODE_PROBE_ROWS, "prefill": (PREFILL_PROBE_ROWS,)}
    assert all(r <= DECODE_ROWS for r in DECODE_PROBE_ROWS) and PREFILL_PROBE_ROWS > DECODE_ROWS
    for shape_class, row_counts in classes.items():
        for name in CPU_KERNELS:
            if name == "skinny" and shape_class == "prefill":
                continue  # built for decode (the head alone uses it past DECODE_ROWS)
            if not kernel_usable(name, dtype, cpu):
                continue
            choice = KernelChoice(decode=name if shape_class == "decode" else "torch",
                                  prefill=name if shape_class == "prefill" else "torch")
            # Packed copies exist only while this kernel is timed.
            linears = [
                Linear(w, None, choice)
                for w in (weights if shape_class == "decode" else one_per_shape)
            ]
            total = sum(_time(linears, rows, dtype) for rows in row_counts)
            timings[f"{shape_class}/{name}"] = round(total * 1e3, 3)
            if shape_class not in best or total < best[shape_class][0]:
                best[shape_class] = (total, name)
    return KernelChoice(decode=best["decode"][1], prefill=best["prefill"][1]), timings


@torch.inference_mode()
def _time(linears: list[Linear], rows: int, dtype: torch.dtype) -> float:
    """Seconds for one pass over every weight, best of a few (after a warm-up pass)."""
    inputs = [torch.randn(rows, lin.dense().shape[1]).to(dtype) for lin in linears]
    best = float("inf")
    for repeat in range(4):
        start = time.perf_counter()
        for lin, x in zip(linears, inputs):
            lin(x)
        if repeat:
            best = min(best, time.perf_counter() - start)
    return best
