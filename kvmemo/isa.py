"""The instruction set kvmemo runs at: the CPU's own, or a lower level forced by KVMEMO_ISA.

Invariant: every layer that picks code by CPU feature sees the same level: torch's ATen kernels
(ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA), MKL (MKL_ENABLE_INSTRUCTIONS), kvmemo's C
kernels (their -march and cache key), the linear-kernel probe and dtype "auto" (the masked flags).
So an AVX-512 machine forced to "avx2" computes as an AVX2-only one does, and a change tuned on
one CPU is tested on the others. torch and oneDNN read their variables once, at first use, so the
switch is applied when `kvmemo` is imported (stdlib only: `import kvmemo.kv` stays torch-free).
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ENV = "KVMEMO_ISA"
_SET_BY_KVMEMO = "KVMEMO_ISA_SET"  # the variables apply() set (not the user): children redo them


class IsaError(ValueError):
    """KVMEMO_ISA names an unknown level, or one this CPU cannot run (one line: what, and the
    allowed values)."""


@dataclass(frozen=True)
class IsaLevel:
    """One instruction-set level and how each layer is told to stay at or below it."""

    name: str
    aten: str  # ATEN_CPU_CAPABILITY: default | avx2 | avx512
    onednn: str  # ONEDNN_MAX_CPU_ISA (a cap: a CPU with less uses what it has)
    mkl: str  # MKL_ENABLE_INSTRUCTIONS
    cflags: tuple[str, ...]  # the C kernels' target flags
    required: frozenset[str]  # /proc/cpuinfo flags the CPU must have to run this level
    dropped_prefixes: tuple[str, ...]  # flags above the level, hidden from every probe


LEVELS: dict[str, IsaLevel] = {
    level.name: level
    for level in (
        # Plain x86-64 (SSE2): the portable C paths, ATen's default kernels.
        IsaLevel("scalar", "default", "SSE41", "SSE4_2", ("-march=x86-64",), frozenset(),
                 ("avx", "amx", "fma", "f16c", "vaes", "vpclmulqdq", "gfni")),
        # x86-64-v3: AVX2, FMA, F16C (Zen 3, Haswell..): no VNNI, no bf16, no AVX-512.
        # Required: what -march=x86-64-v3 lets the compiler use (abm is LZCNT), so a VM that
        # hides one of them is not taken for this level.
        IsaLevel("avx2", "avx2", "AVX2", "AVX2", ("-march=x86-64-v3",),
                 frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe",
                            "xsave"}),
                 ("avx512", "avx_", "amx", "avx10")),
        # AVX-512 with whatever extensions the CPU has (VNNI, bf16), AMX left out.
        IsaLevel("avx512", "avx512", "AVX512_CORE_FP16", "AVX512",
                 ("-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"),
                 frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}), ("amx",)),
    )
}
ALLOWED = ("native", *LEVELS)


def raw_cpu_flags() -> frozenset[str]:
    """The CPU's own feature flags (empty where /proc/cpuinfo is unreadable)."""
    return frozenset(_cpuinfo_field(("flags", "Features")).split())


def cpu_name() -> str:
    return _cpuinfo_field(("model name",)) or platform.processor() or platform.machine()


def native_level() -> str:
    """The highest level this CPU runs (x86 only; other machines report "native")."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "native"
    flags = raw_cpu_flags()
    for name in ("avx512", "avx2"):
        if LEVELS[name].required <= flags:
            return name
    return "scalar"


def forced() -> IsaLevel | None:
    """The level KVMEMO_ISA forces, or None (unset or "native"); IsaError if it is unknown or
    above this CPU."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "native"):
        return None
    if value not in LEVELS:
        raise IsaError(f"{ENV} must be one of {', '.join(ALLOWED)}; got {value!r}")
    level = LEVELS[value]
    if platform.machine() not in ("x86_64", "AMD64"):
        raise IsaError(f"{ENV}={value} forces an x86 level; this machine is "
                       f"{platform.machine()} (allowed here: native)")
    missing = sorted(level.required - raw_cpu_flags())
    if missing:
        allowed = ["native", *(n for n, lv in LEVELS.items() if lv.required <= raw_cpu_flags())]
        raise IsaError(f"{ENV}={value} needs the CPU feature(s) {', '.join(missing)}, which "
                       f"this CPU ({cpu_name()}) lacks; allowed here: {', '.join(allowed)}")
    return level


def active() -> str:
    """The level kvmemo computes at: the forced one, else the CPU's own (recorded with every
    benchmark figure)."""
    level = forced()
    return level.name if level is not None else native_level()


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as every probe must see them: those above a forced level removed."""
    flags = raw_cpu_flags()
    level = forced()
    if level is None:
        return flags
    return frozenset(f for f in flags if not f.startswith(level.dropped_prefixes))


def kernel_cflags() -> tuple[str, ...]:
    """The target flags kvmemo's C kernels are built with at the active level."""
    level = forced()
    return ("-march=native",) if level is None else level.cflags


def apply(environ: MutableMapping[str, str] = os.environ) -> None:
    """Tells torch, oneDNN and MKL the forced level through `environ` (a no-op without one).
    Variables the user set explicitly win; those a parent kvmemo process set for its own level
    (named in KVMEMO_ISA_SET) give way, so a child may run at another level. This runs before
    torch reads them (see the module docstring)."""
    for name in filter(None, environ.pop(_SET_BY_KVMEMO, "").split(",")):
        environ.pop(name, None)
    level = forced()
    if level is None:
        return
    wanted = {"ATEN_CPU_CAPABILITY": level.aten, "ONEDNN_MAX_CPU_ISA": level.onednn,
              "DNNL_MAX_CPU_ISA": level.onednn, "MKL_ENABLE_INSTRUCTIONS": level.mkl}
    set_here = [name for name in wanted if name not in environ]
    for name in set_here:
        environ[name] = wanted[name]
    if set_here:
        environ[_SET_BY_KVMEMO] = ",".join(set_here)


def check_torch() -> None:
    """IsaError if torch had fixed its kernels' level before the switch was applied (torch
    imported and used before kvmemo): a forced run that silently runs native tests nothing."""
    level = forced()
    if level is None:
        return
    import torch

    got = torch.backends.cpu.get_cpu_capability().lower()
    want = {"scalar": "default"}.get(level.name, level.name)
    if not got.startswith(want) and not (want == "avx512" and got.startswith("avx512")):
        raise IsaError(f"{ENV}={level.name} was set after torch chose its {got} kernels: set it "
                       f"in the environment before the process starts")


@cache
def _cpuinfo_lines() -> tuple[str, ...]:
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def _cpuinfo_field(names: tuple[str, ...]) -> str:
    for line in _cpuinfo_lines():
        if line.startswith(names):
            return line.partition(":")[2].strip()
    return ""


def levels_below_native() -> list[str]:
    """The forced levels this machine can run below its own, lowest first (what `make test`
    runs the kernel and model suites under)."""
    native = native_level()
    order = list(LEVELS)
    return order[: order.index(native)] if native in order else []


def describe() -> str:
    """The CPU, its own level, the active one and those below (`kvmemo isa`)."""
    return (f"cpu: {cpu_name()}\nnative level: {native_level()}\nactive level: {active()}\n"
            f"levels below native: {', '.join(levels_below_native()) or 'none'}")
