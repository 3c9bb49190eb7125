"""AttentionBackend: the one per-layer call that writes a step's K/V into the pages and attends.

Invariant: forward(layer, ...) first writes (quantising for fp8) every new token's K and V into
its slot, then computes attention for the mixed batch of prefill chunks and decodes described by
the step's AttentionMetadata, reading K/V only through the pages. Every backend equals
ReferenceAttentionBackend to float tolerance.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvmemo.attention.cache import PagedKVCache, dequantize_fp8
from kvmemo.attention.cascade import cascade_attention
from kvmemo.attention.fp8_fold import fold_fp8_query, unfold_fp8_output
from kvmemo.attention.fused_decode import FusedDecode
from kvmemo.attention.invariant import RowPlan
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.attention.names import ATTENTION_BACKENDS
from kvmemo.attention.paged import StepPlan, grouped_attention, paged_attention_pages
from kvmemo.attention.prefix_packs import PrefixPacks
from kvmemo.attention.step_checks import check_metadata_fits_cache, check_step_tensors
from kvmemo.attention.torch_ref import paged_attention_ref
from kvmemo.attention.workspace import Workspace
from kvmemo.triton_support import triton_unavailable_reason


class AttentionBackend(Protocol):
    """Writes K/V and attends, one layer at a time; owns its scratch memory, not the cache."""

    name: str

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D], RoPE applied
        k: torch.Tensor,  # [T, Hkv, D], RoPE applied
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


class PagedAttentionBackend:
    """The default backend (CPU and CUDA): batched decode, per-sequence prefill, cascade prefixes.

    batch_invariant (the default): every query row through the decode kernel's per-query loop
    (invariant.py), so a query's output never depends on the rest of the step; steps that plan
    cannot serve (no C compiler, a window hiding keys) and batch_invariant=False take the
    faster paths below: cascade over shared prefixes, flash prefill, keys split over threads.

    Owns a Workspace of gather buffers and the StepPlan of the current step, rebuilt only when a
    new metadata object arrives (once per step, shared by all layers).
    """

    name = "paged"

    def __init__(self, scale: float, batch_invariant: bool = True):
        self.scale = scale
        self.batch_invariant = batch_invariant
        self._rows: RowPlan | None = None  # this step's, when batch_invariant and it serves
        self.workspace = Workspace()
        self._plan_metadata: AttentionMetadata | None = None
        self._plan: StepPlan | None = None
        # This step's KV write + attention in one kernel call per part, when it is a plain
        # decode step (fused_decode.py); None otherwise.
        self._fused: FusedDecode | None = None
        # Shared prefixes packed for the flash kernel, kept across decode steps while their
        # blocks stand (prefix_packs.py); inert until the engine hands over the block pool's
        # generations (ModelRunner.track_block_generations).
        self.prefix_packs = PrefixPacks()

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        plan = self._plan_for(metadata, kv_cache, q)
        check_step_tensors(q, k, v, kv_cache, metadata)
        if plan is None:  # every row alone (batch-invariant)
            assert self._rows is not None
            return self._rows.attend(layer, q, k, v, kv_cache, self.scale)
        fused = self._fused
        if fused is not None and fused.kernel.write_fits(q, k, v):
            # Every sequence decodes: one C call per part writes the KV and attends (from a
            # shared prefix's attention as its starting state), with no tensor ops between;
            # at one token they cost more than the work.
            return fused(layer, q, k, v, kv_cache, self.scale, self.workspace)
        kv_cache.write(layer, k, v, metadata.slot_mapping)  # first: queries see their own keys
        q = fold_fp8_query(q, kv_cache, layer)
        if plan.cascade_blocks:
            out = cascade_attention(
                q, *kv_cache.logical_caches(layer), metadata,
                plan.cascade_blocks, self.scale, self.workspace, plan.cascade_first_block,
            )
        elif plan.groups:  # groups of sequences share prefixes, the whole batch does not
            out = grouped_attention(
                q, kv_cache.k_pages[layer], kv_cache.v_pages[layer], plan, self.scale,
                self.workspace,
            )
        else:
            out = paged_attention_pages(
                q, kv_cache.k_pages[layer], kv_cache.v_pages[layer], plan, self.scale,
                self.workspace,
            )
        return unfold_fp8_output(out, kv_cache, layer)

    def _plan_for(self, metadata: AttentionMetadata, kv_cache: PagedKVCache,
                  q: torch.Tensor) -> StepPlan | None:
        """The step's StepPlan, or None when the row plan serves the step; built once a step."""
        if metadata is not self._plan_metadata:
            check_metadata_fits_cache(metadata, kv_cache)
            self._plan_metadata = metadata
            self._rows = RowPlan.build(metadata, kv_cache, q) if self.batch_invariant else None
            self._plan = None if self._rows is not None else StepPlan.build(metadata)
            self._fused = None if self._plan is None else FusedDecode.plan(
                self._plan, metadata, kv_cache, self.prefix_packs)
        return self._plan


class ReferenceAttentionBackend:
    """torch_ref over dequantised pages, one sequence at a time: slow, obviously correct."""

    name = "reference"

    def __init__(self, scale: float):
        self.scale = scale

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        check_metadata_fits_cache(metadata, kv_cache)
        check_step_tensors(q, k, v, kv_cache, metadata)
        kv_cache.write(layer, k, v, metadata.slot_mapping)
        k_cache, v_cache = dequantized_caches(kv_cache, layer, q.dtype)
        return paged_attention_ref(q, k_cache, v_cache, metadata, self.scale)


def select_attention_backend(
    name: str, scale: float, device: torch.device | str = "cpu", batch_invariant: bool = True,
) -> AttentionBackend:
    """The backend called `name`: 'paged' (CPU kernels and torch), 'triton' (Triton kernels:
    CUDA, or CPU under TRITON_INTERPRET=1), 'reference', or 'auto' (triton on CUDA when triton
    is installed, else paged). batch_invariant: the paged backend's (the Triton kernels are
    batch-invariant by construction, the reference computes one sequence at a time)."""
    if name == "auto":
        name = "paged"
        if torch.device(device).type == "cuda" and triton_unavailable_reason(device) is None:
            name = "triton"
    if name == "paged":
        return PagedAttentionBackend(scale, batch_invariant)
    if name == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"attention backend 'triton' cannot run: {reason}")
        from kvmemo.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(scale)
    if name == "reference":
        return ReferenceAttentionBackend(scale)
    raise ValueError(f"attention backend must be one of {list(ATTENTION_BACKENDS)}, got {name!r}")


def dequantized_caches(
    kv_cache: PagedKVCache, layer: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s logical K and V caches [num_blocks, bs, Hkv, D] as real values in `dtype`."""
    k, v = kv_cache.logical_caches(layer)
    if not kv_cache.is_fp8:
        return k.to(dtype), v.to(dtype)
    return (
        dequantize_fp8(k, kv_cache.fp8_transform(layer, "k"), dtype),
        dequantize_fp8(v, kv_cache.fp8_transform(layer, "v"), dtype),
    )
