"""TritonAttentionBackend: the KV write and paged attention as Triton kernels (the GPU's backend).

The same kernels run on the CPU under Triton's interpreter, which is how CI tests them; the
engine picks this backend on CUDA (`attention_backend="auto"`). fp8 pages hold raw e4m3 values:
the query is folded and the output unfolded as in the paged backend (fp8_fold.fold_fp8_query),
so the kernels only read them.
"""

from __future__ import annotations

import torch

from kvmemo.attention.cache import PagedKVCache, quantize_fp8
from kvmemo.attention.fp8_fold import fold_fp8_query, unfold_fp8_output
from kvmemo.attention.kernels.triton_attention import (
    MAX_BLOCK_SIZE,
    TilePlan,
    paged_attention,
    write_pages,
)
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.attention.step_checks import check_metadata_fits_cache, check_step_tensors
from kvmemo.triton_support import triton_unavailable_reason


class TritonAttentionBackend:
    """Writes K/V and attends with the Triton kernels; one TilePlan per step, shared by layers.

    split: None picks by occupancy (split the keys into segments when the step's tiles alone
    would leave most of the GPU's multiprocessors idle, as a batch-1 decode does); True or False
    forces it. The result is the same bits either way.
    """

    name = "triton"

    def __init__(self, scale: float, split: bool | None = None):
        self.scale = scale
        self.split = split
        self._plan_metadata: AttentionMetadata | None = None
        self._plan: TilePlan | None = None
        self._static_split: bool | None = None  # set while a CUDA graph is captured
        self._processors: int | None = None  # the GPU's SMs, read once

    def use_static_plan(
        self, metadata: AttentionMetadata | None, plan: TilePlan | None, split: bool | None
    ) -> None:
        """CUDA graph capture (engine/cuda_graphs.py): attend with `plan` whenever `metadata`
        comes (their tensors are the graph's static inputs), split as told; None clears it."""
        self._plan_metadata, self._plan, self._static_split = metadata, plan, split

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
        self.write(layer, k, v, kv_cache, metadata.slot_mapping)
        folded = fold_fp8_query(q, kv_cache, layer)
        out = paged_attention(
            folded, kv_cache.k_pages[layer], kv_cache.v_pages[layer], metadata.block_tables,
            plan, self.scale, metadata.sliding_window, split=self._split(plan, kv_cache, q),
        )
        return unfold_fp8_output(out, kv_cache, layer)

    @staticmethod
    def write(
        layer: int, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        """This step's K and V into their slots; an fp8 cache quantises them first, with the
        paged backend's rounding (quantize_fp8), so pages are the same bytes whoever wrote them."""
        k_pages, v_pages = kv_cache.k_pages[layer], kv_cache.v_pages[layer]
        if kv_cache.is_fp8:
            k = quantize_fp8(k, kv_cache.fp8_transform(layer, "k"))
            v = quantize_fp8(v, kv_cache.fp8_transform(layer, "v"))
        write_pages(k_pages, v_pages, k.to(k_pages.dtype), v.to(v_pages.dtype), slot_mapping)

    def _plan_for(
        self, metadata: AttentionMetadata, kv_cache: PagedKVCache, q: torch.Tensor
    ) -> TilePlan:
        if metadata is not self._plan_metadata or self._plan is None:
            check_metadata_fits_cache(metadata, kv_cache)
            check_triton_fits(kv_cache, q.device)
            group = q.shape[1] // kv_cache.num_kv_heads
            self._plan = TilePlan.build(metadata.query_lens, metadata.seq_lens, group, q.device)
            self._plan_metadata = metadata
        return self._plan

    def _split(self, plan: TilePlan, kv_cache: PagedKVCache, q: torch.Tensor) -> bool:
        if self._static_split is not None:
            return self._static_split
        if self.split is not None:
            return self.split
        if plan.num_segments == 1 or q.device.type != "cuda":
            return False
        if self._processors is None:
            self._processors = torch.cuda.get_device_properties(q.device).multi_processor_count
        return plan.num_tiles * kv_cache.num_kv_heads < self._processors


def check_triton_fits(kv_cache: PagedKVCache, device: torch.device) -> None:
    """Raises ValueError when the Triton kernels cannot run here or on this cache's layout."""
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"attention backend 'triton' cannot run: {reason}")
    bs = kv_cache.block_size
    if bs & (bs - 1) or bs > MAX_BLOCK_SIZE:
        raise ValueError(
            f"attention backend 'triton' needs a power-of-two block_size <= {MAX_BLOCK_SIZE}, "
            f"got {bs}; use attention_backend='paged'"
        )
