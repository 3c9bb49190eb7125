"""Attention tests marked with this fixture run twice: through the compiled CPU kernels (decode,
flash prefill) and through torch's gather + SDPA / flash fallback (what a machine without a C
compiler or AVX-512, or CUDA, uses)."""

from __future__ import annotations

import pytest

from kvmemo.attention import cascade, fused_decode, invariant, lse_attention, paged
from kvmemo.attention.kernels.paged_decode import load_decode_kernel


@pytest.fixture(params=["kernel", "gather"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "kernel":
        if load_decode_kernel() is None:
            pytest.skip("no C compiler here: the CPU decode kernel cannot be built")
    else:
        for module in (paged, cascade):  # torch's kernels only: the compiled ones step aside
            monkeypatch.setattr(module, "load_decode_kernel", lambda: None)
        for module in (paged, lse_attention):
            monkeypatch.setattr(module, "flash_attention", lambda *args, **kwargs: None)
        monkeypatch.setattr(fused_decode, "load_decode_kernel", lambda: None)  # the fused KV write
        monkeypatch.setattr(invariant, "load_decode_kernel", lambda: None)  # per-row plans
    return request.param
