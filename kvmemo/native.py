"""CPU kernels in plain C: compiled once per machine with the system compiler, cached, loaded.

Invariant: `load_library(source, purpose)` returns a loaded library or None, never raises; None (no
C compiler, a failed build, KVMEMO_CPU_KERNEL=0) means the caller uses its torch path, which
computes the same values. A shared object is cached under <cache_root>/kernels/<source stem>-
<digest of source and its local headers, flags, compiler, CPU>.so, written to a temp file and
renamed, so concurrent processes and a different CPU behind the same home directory are safe.

Why plain C and ctypes, not torch C++ extensions: torch's headers make a build take minutes (210 s
measured here), a plain C file about a second, and the kernels only need raw pointers. They link
the OpenMP runtime torch already loaded (same soname), so they share torch's threads and count.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvmemo import isa
from kvmemo.paths import cache_root

logger = logging.getLogger(__name__)

# Reassociation lets the reductions use SIMD lanes. Not -ffast-math: linking a shared object
# with it pulls in crtfastmath.o, which at load time turns on flush-to-zero / denormals-are-zero
# for the whole process (it broke hypothesis's float generation in the test suite, and would
# change torch's numerics); finite-math must stay off anyway, the online softmax starts at -inf.
CFLAGS = [
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
    "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-fPIC", "-shared",
]


def load_library(source: Path, purpose: str, march: str = "native") -> ctypes.CDLL | None:
    """The compiled `source` for this machine (built on first use, then cached), or None.

    `purpose` names the kernel and its fallback in the log line a missing kernel gets. `march`
    builds for another target than this CPU's full instruction set (tests use it to run a
    kernel's AVX2 and plain-C paths on an AVX-512 machine): "x86-64-v3", "x86-64", ...
    """
    if os.environ.get("KVMEMO_CPU_KERNEL", "1") == "0":
        logger.info("CPU kernels disabled by KVMEMO_CPU_KERNEL=0: %s", purpose)
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler (cc/gcc) found: %s (slower)", purpose)
        return None
    try:
        return _load_or_rebuild(source, compiler, march)
    except (OSError, subprocess.SubprocessError, isa.IsaError) as e:
        logger.warning("CPU kernel %s unavailable (%s): %s (slower)", source.name, e, purpose)
        return None


def _load_or_rebuild(source: Path, compiler: str, march: str) -> ctypes.CDLL:
    """The cached build, or a fresh one when the cached file does not load (truncated, damaged)."""
    path = _build(source, compiler, march)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("rebuilding unreadable cached kernel %s: %s", path, e)
        path.unlink(missing_ok=True)
        return ctypes.CDLL(str(_build(source, compiler, march)))


def _build(source: Path, compiler: str, march: str = "native") -> Path:
    """Compile source unless a build for this source, compiler, flags and CPU is cached."""
    # "native" means the active instruction-set level: the CPU's own, or the one KVMEMO_ISA forces.
    target_flags = list(isa.kernel_cflags()) if march == "native" else [f"-march={march}"]
    flags = [g for f in CFLAGS for g in (target_flags if f == "-march=native" else [f])]
    text = source.read_bytes()
    # Local headers (#include "x.h" beside the source) are part of what is built.
    for header in sorted(set(re.findall(rb'#include "([^"]+)"', text))):
        text += (source.parent / header.decode()).read_bytes()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    key = hashlib.sha256(text)
    for part in (" ".join(flags), version, platform.machine(), cpu_flags()):
        key.update(part.encode())
    target = cache_root() / "kernels" / f"{source.stem}-{key.hexdigest()[:20]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *flags, str(source), "-o", str(built), "-lm"],
            capture_output=True, text=True, timeout=300,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: another process sees the whole file or none
    logger.info("built CPU kernel %s", target)
    return target


def cpu_has_bf16_products() -> bool:
    """The CPU multiplies bf16 in hardware (avx512_bf16 or AMX) at the active instruction-set
    level: there a bf16 GEMM runs at about twice the fp32 rate; elsewhere bf16 is emulated and
    slower than fp32."""
    return bool(set(cpu_flags().split()) & {"avx512_bf16", "amx_bf16"})


def cpu_flags() -> str:
    """The CPU's feature flags at the active level, sorted (-march=native code must not run on
    another CPU model, nor a forced level's build be taken for the native one)."""
    return " ".join(sorted(isa.cpu_flags())) or platform.processor()
