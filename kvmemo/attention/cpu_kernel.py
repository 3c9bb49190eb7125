"""The compiled CPU decode kernel (kernels/paged_decode.c): built once per machine, called via ctypes.

Invariant: `load_decode_kernel()` returns a working kernel or None, never raises; None (no C
compiler, a failed build, a non-x86/ARM oddity, KVMEMO_CPU_KERNEL=0) means callers use the torch
gather + SDPA path, which computes the same values. The shared object is cached under
<cache_root>/kernels/<digest of source, flags, compiler, CPU>.so, written to a temp file and
renamed, so concurrent processes and a different CPU behind the same home directory are safe.

Why a plain C file and ctypes, not a torch C++ extension: torch's headers make a build take
minutes, this one takes about a second, and the kernel only needs raw pointers. It links the
OpenMP runtime torch already loaded (same soname), so it shares torch's threads and thread count.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kvmemo.attention.cache import FP8_DTYPE
from kvmemo.paths import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "paged_decode.c"
# Reassociation lets the reductions use SIMD lanes. Not -ffast-math: linking a shared object
# with it pulls in crtfastmath.o, which at load time turns on flush-to-zero / denormals-are-zero
# for the whole process (it broke hypothesis's float generation in the test suite, and would
# change torch's numerics); finite-math must stay off anyway, the online softmax starts at -inf.
CFLAGS = [
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
    "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-fPIC", "-shared",
]
KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, FP8_DTYPE: 3}
MAX_HEAD_DIM, MAX_GROUP = 256, 32  # the C kernel's fixed tile buffers

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


@dataclass(frozen=True)
class DecodeKernel:
    """The loaded shared object and where it came from."""

    path: Path
    fn: ctypes._CFuncPtr

    def supports(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
        """True when this kernel can run the shapes, dtypes and layout (else use the torch path)."""
        num_kv_heads, head_dim = k_pages.shape[0], k_pages.shape[-1]
        return (
            q.device.type == "cpu"
            and k_pages.device.type == "cpu"
            and k_pages.dtype in KV_DTYPE_CODES
            and v_pages.dtype == k_pages.dtype
            and k_pages.is_contiguous()
            and v_pages.is_contiguous()
            and head_dim <= MAX_HEAD_DIM
            and q.shape[1] % num_kv_heads == 0
            and q.shape[1] // num_kv_heads <= MAX_GROUP
        )

    def __call__(
        self,
        q: torch.Tensor,  # [B, Hq, D]
        k_pages: torch.Tensor,  # [Hkv, num_blocks, bs, D] contiguous
        v_pages: torch.Tensor,
        block_tables: torch.Tensor,  # [S, max_blocks] int64
        table_rows: torch.Tensor | None,  # [B] int64: the block_tables row of each query; None: row b
        first_block: int,  # table entries to skip (a cascade suffix starts after the prefix)
        kv_lens: torch.Tensor,  # [B] int64 keys per sequence, counted from first_block
        scale: float,
        with_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention output [B, Hq, D] in q's dtype and, if asked, the fp32 log-sum-exp [B, Hq]."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads, num_blocks, block_size, _ = k_pages.shape
        if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
            raise ValueError("the decode kernel reads pages [Hkv, num_blocks, bs, D] that are contiguous")
        q32 = q.to(torch.float32).contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        rows = None if table_rows is None else table_rows.to(torch.int64).contiguous()
        lens = kv_lens.to(torch.int64).contiguous()
        out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
        lse = torch.empty(batch, num_heads, dtype=torch.float32) if with_lse else None
        status = self.fn(
            q32.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), KV_DTYPE_CODES[k_pages.dtype],
            tables.data_ptr(), tables.shape[1], None if rows is None else rows.data_ptr(),
            first_block, lens.data_ptr(), batch, num_heads, num_kv_heads, head_dim, block_size,
            num_blocks, scale, out.data_ptr(), None if lse is None else lse.data_ptr(),
        )
        if status != 0:
            raise ValueError(
                f"decode kernel cannot run head_dim {head_dim} with {num_heads} q / {num_kv_heads} "
                f"kv heads (head_dim <= {MAX_HEAD_DIM}, group <= {MAX_GROUP}); check supports() first"
            )
        return out.to(q.dtype), lse


@cache
def load_decode_kernel() -> DecodeKernel | None:
    """The kernel for this machine (built on first use, then cached on disk), or None."""
    if os.environ.get("KVMEMO_CPU_KERNEL", "1") == "0":
        logger.info("CPU decode kernel disabled by KVMEMO_CPU_KERNEL=0: using gather + SDPA")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler (cc/gcc) found: CPU decode uses gather + SDPA (slower)")
        return None
    try:
        library = _load_or_rebuild(compiler)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU decode kernel unavailable (%s): using gather + SDPA (slower)", e)
        return None
    fn = library.kvmemo_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [
        _p, _p, _p, ctypes.c_int, _p, _i64, _p, _i64, _p,
        _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _p, _p,
    ]
    return DecodeKernel(path=Path(library._name), fn=fn)


def _load_or_rebuild(compiler: str) -> ctypes.CDLL:
    """The cached build, or a fresh one when the cached file does not load (truncated, damaged)."""
    path = _build(compiler)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("rebuilding unreadable cached kernel %s: %s", path, e)
        path.unlink(missing_ok=True)
        return ctypes.CDLL(str(_build(compiler)))


def _build(compiler: str) -> Path:
    """Compile SOURCE unless a build for this source, compiler, flags and CPU is cached."""
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(source)
    for part in (" ".join(CFLAGS), version, platform.machine(), _cpu_flags()):
        key.update(part.encode())
    target = cache_root() / "kernels" / f"paged_decode-{key.hexdigest()[:20]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *CFLAGS, str(SOURCE), "-o", str(built), "-lm"],
            capture_output=True, text=True, timeout=300,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: another process sees the whole file or none
    logger.info("built CPU decode kernel %s", target)
    return target


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native code must not run on another CPU model)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
