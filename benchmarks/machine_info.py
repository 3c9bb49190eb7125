"""Which machine a benchmark ran on: CPU model, family and model number, its widest vector
instruction set and its bf16 products.

The model name alone is not enough here: the VM reports "AMD EPYC" for an AVX2-only Zen 3, a
Zen 4 and a Zen 5, and the same workload's speed differs between them by 2x. Stdlib only, so
the peers' virtualenvs can import it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def vector_isa() -> str:
    """'avx512', 'avx2', 'neon' or the machine name when neither is known."""
    flags = set((_cpuinfo_field("flags") or _cpuinfo_field("Features") or "").split())
    for isa, flag in (("avx512", "avx512f"), ("avx2", "avx2"), ("neon", "asimd")):
        if flag in flags:
            return isa
    return platform.machine()


def forced_isa() -> str | None:
    """The instruction-set level KVMEMO_ISA forces (kvmemo/isa.py), or None for the native one."""
    value = os.environ.get("KVMEMO_ISA", "").strip().lower()
    return None if value in ("", "native") else value


def cpu_label() -> str:
    """e.g. 'AMD EPYC family 25 model 17 (avx512, avx512_bf16)', and ', forced avx2' where
    KVMEMO_ISA forces a lower level: the VM names Zen 4 and Zen 5 alike, and they differ by ~2x
    here (Zen 4 runs 512-bit instructions in two halves)."""
    name = _cpuinfo_field("model name") or platform.machine()
    family, model = _cpuinfo_field("cpu family"), _cpuinfo_field("model\t")
    if family and model:
        name = f"{name} family {family} model {model}"
    flags = set((_cpuinfo_field("flags") or "").split())
    extras = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    forced = forced_isa()
    if forced:
        extras.append(f"forced {forced}")
    return f"{name} ({', '.join([vector_isa(), *extras])})"
