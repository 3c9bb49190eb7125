"""Batch-invariant attention: every query row attends alone, through one kernel, in one pass.

Invariant: a query's output is a function of its own q and the keys and values at positions
0..p of its sequence (p its position), computed by the decode kernel's per-row arithmetic
(kernels/row_chunks.h: chunks of 64 keys from the row's first key, each score and each output
value one fixed chain, never split over threads), whatever else the step holds: the other
sequences of a batch, a cascade prefix shared with them, the chunk its prompt was cut into,
whether its earlier keys were computed in this step, came from the prefix cache, the disk store
or Redis. With row-invariant projections (native weights' kernels) a token's logits, and so the
tokens and logprobs of a request, do not depend on how the engine batched or cached it.

Why not flash attention over a prefill chunk: the flash kernel's softmax chunks start where the
chunk starts and cascade's log-sum-exp merges are other arithmetic than one query's loop, so a
prompt's last token would differ between a cold prefill and a decode-sized suffix after a cache
hit. The kernel still shares work between rows: a prefill's rows go in groups that share each
chunk of keys (transposed once per group, or once per sequence for all its groups), which is
register blocking, not other arithmetic; docs/benchmarks.md has its cost against flash.

A sliding window is each row's first key (kv_starts). The row's chunks start at that key's page
(row_chunks.h), fixed by the row's own position (the tables are cropped by whole pages), so a
windowed row too gets the same bits in any step, and a prefill's windowed rows whose first keys
share a page share their chunks.

Steps this plan cannot serve return None from RowPlan.build and take the backend's other paths:
no C compiler, a head size or group the kernel's buffers do not take, a non-CPU device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.fp8_fold import fold_fp8_query, unfold_fp8_output
from kvmemo.attention.kernels.paged_decode import DecodeKernel, load_decode_kernel
from kvmemo.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Each query row of a step as its own item of the decode kernel."""

    kernel: DecodeKernel
    metadata: AttentionMetadata
    table_rows: torch.Tensor | None  # [T] int64: the sequence of each row; None: row t is seq t
    kv_lens: torch.Tensor  # [T] int64: keys up to row t's own (its position + 1, in the table)
    kv_starts: torch.Tensor | None  # [T] int64: row t's first key (a sliding window); None: 0

    @classmethod
    def build(cls, metadata: AttentionMetadata, kv_cache: PagedKVCache,
              q: torch.Tensor) -> RowPlan | None:
        """The step's plan (q: any layer's queries, for their head count), or None."""
        kernel = load_decode_kernel()
        if kernel is None or not kernel.supports(q, kv_cache.k_pages[0], kv_cache.v_pages[0]):
            return None
        if all(n == 1 for n in metadata.query_lens):  # a decode step: row s is sequence s
            table_rows, kv_lens = None, metadata.seq_lens_t.contiguous()
        else:
            query_lens = metadata.query_lens_t
            table_rows = torch.repeat_interleave(torch.arange(metadata.num_seqs), query_lens)
            # row i of sequence s (of n new tokens, L keys in all) sees L - n + i + 1 keys
            first = torch.repeat_interleave(metadata.seq_lens_t - query_lens, query_lens)
            offsets = torch.arange(len(table_rows)) - torch.repeat_interleave(
                torch.tensor(metadata.query_start_loc[:-1]), query_lens)
            kv_lens = (first + offsets + 1).contiguous()
        window = metadata.sliding_window
        kv_starts = None
        if window is not None and max(metadata.seq_lens, default=0) > window:
            # the row at key index L - 1 sees keys L - window .. L - 1
            kv_starts = (kv_lens - window).clamp_(min=0).contiguous()
        return cls(kernel, metadata, table_rows, kv_lens, kv_starts)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: PagedKVCache, scale: float) -> torch.Tensor:
        """Writes the step's K/V into their slots, then each row attends: [T, Hq, D]."""
        metadata, kernel = self.metadata, self.kernel
        k_pages, v_pages = kv_cache.k_pages[layer], kv_cache.v_pages[layer]
        tables = metadata.block_tables
        if (self.table_rows is None and q.dtype == torch.float32 and not kv_cache.is_fp8
                and kv_cache.dtype == torch.float32 and kernel.write_fits(q, k, v)
                and metadata.slot_mapping.dtype == torch.int64):
            # The write folded into the same per-row arithmetic (fp32 in and out: the loop reads
            # q as the unfused call does, so both give the same bits).
            return kernel.write_and_decode(q, k, v, metadata.slot_mapping, k_pages, v_pages,
                                           tables, None, self.kv_lens, scale, split=False,
                                           kv_starts=self.kv_starts)
        kv_cache.write(layer, k, v, metadata.slot_mapping)  # first: rows see their own keys
        folded = fold_fp8_query(q, kv_cache, layer)
        out = kernel(folded, k_pages, v_pages, tables, self.table_rows, 0, self.kv_lens, scale,
                     split=False, kv_starts=self.kv_starts)[0]
        return unfold_fp8_output(out, kv_cache, layer)
