"""A decode step's KV write and attention in one decode-kernel call per part of the batch.

Invariant: computes what the backend's general path computes (write every new K/V into its slot,
then attend; over a shared prefix, cascade's prefix attention merged with the rest), for steps
where every sequence decodes one token on fp32/bf16 CPU pages with no sliding window hiding
keys (plan() returns None otherwise). A part is the whole batch, a cascade group of it (its
shared prefix attended once for the group by the flash kernel, whose output and log-sum-exp
are the decode kernel's starting state, so the merge happens in place), or the sequences in
no group. Why: at one token per sequence the general path's tensor ops (the KV write's
index_copy, the suffix's preparation, the merge) cost more than their arithmetic.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.cascade import cascade_prefix_state, prefix_kv
from kvmemo.attention.kernels.flash_attention import PackedKV, pack_kv
from kvmemo.attention.kernels.paged_decode import DecodeKernel, load_decode_kernel
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.attention.paged import StepPlan
from kvmemo.attention.prefix_packs import PrefixKey, PrefixPacks
from kvmemo.attention.workspace import Workspace


@dataclass(frozen=True, slots=True)
class DecodePart:
    """Sequences whose queries one kernel call serves."""

    rows: torch.Tensor | None  # [B] their query rows in the step's batch; None: every row
    slots: torch.Tensor  # [B] int64: each new token's slot
    block_tables: torch.Tensor  # [S, max_blocks] int64
    table_rows: torch.Tensor | None  # [B] int64: the block_tables row of each; None: row b
    kv_lens: torch.Tensor  # [B] int64: keys from table entry prefix_blocks on, the new one too
    prefix_blocks: int  # > 0: a cascade prefix shared by the part, attended first
    prefix_first_block: int | None  # its first block id when its ids ascend (read in place)
    metadata: AttentionMetadata | None  # the part's own (a prefix to gather reads its table)
    prefix_key: PrefixKey | None = None  # its prefix's identity in PrefixPacks (None: not kept)


@dataclass(frozen=True, slots=True)
class FusedDecode:
    """One step's parts and the kernel that serves them."""

    kernel: DecodeKernel
    parts: list[DecodePart]
    packs: PrefixPacks | None = None  # shared prefixes packed in earlier steps, kept across

    @classmethod
    def plan(cls, plan: StepPlan, metadata: AttentionMetadata, kv_cache: PagedKVCache,
             packs: PrefixPacks | None = None) -> FusedDecode | None:
        """The step's parts, or None when it is not a plain decode step the kernel can serve.
        With `packs`, each part's prefix is keyed there (and prefixes no part uses dropped)."""
        if (
            not metadata.num_seqs or any(n != 1 for n in metadata.query_lens)
            or plan.prefills or plan.decode_windowed
            or kv_cache.is_fp8 or kv_cache.dtype not in (torch.float32, torch.bfloat16)
            or kv_cache.k_pages[0].device.type != "cpu"
            or metadata.slot_mapping.dtype != torch.int64
        ):
            return None
        kernel = load_decode_kernel()
        probe_q = torch.empty(0, kv_cache.num_kv_heads, kv_cache.k_pages[0].shape[-1])
        if kernel is None or not kernel.supports(probe_q, kv_cache.k_pages[0],
                                                 kv_cache.v_pages[0]):
            return None
        parts: list[DecodePart] | None
        if plan.groups:
            parts = [_cascade_part(g.rows, g.metadata, g.prefix_blocks, g.first_block)
                     for g in plan.groups]
            if plan.rest is not None:
                rest = _plain_part(plan.rest.rows, plan.rest.plan,
                                   metadata.slot_mapping[plan.rest.rows])
                parts = None if rest is None else [*parts, rest]
        elif plan.cascade_blocks:
            parts = [_cascade_part(None, metadata, plan.cascade_blocks, plan.cascade_first_block)]
        else:
            part = _plain_part(None, plan, metadata.slot_mapping)
            parts = None if part is None else [part]
        if parts is None or not all(_int64_contiguous(p) for p in parts):
            return None
        if packs is not None:
            parts = [_keyed(p, packs, kv_cache) for p in parts]
            packs.retain({p.prefix_key for p in parts if p.prefix_key is not None})
        return cls(kernel, parts, packs)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: PagedKVCache, scale: float, workspace: Workspace) -> torch.Tensor:
        """Writes k/v [B, Hkv, D] and returns attention [B, Hq, D] in q's dtype; the caller has
        checked kernel.write_fits(q, k, v)."""
        k_pages, v_pages = kv_cache.k_pages[layer], kv_cache.v_pages[layer]
        if len(self.parts) == 1 and self.parts[0].rows is None:
            return self._run(layer, self.parts[0], q, k, v, k_pages, v_pages, scale, workspace)
        out = torch.empty_like(q)
        for part in self.parts:
            assert part.rows is not None
            # [B_part, ...] copies: contiguous, with the layout write_fits admits
            q_part, k_part, v_part = (t.index_select(0, part.rows) for t in (q, k, v))
            out[part.rows] = self._run(layer, part, q_part, k_part, v_part, k_pages, v_pages,
                                       scale, workspace)
        return out

    def _run(self, layer: int, part: DecodePart, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, scale: float,
             workspace: Workspace) -> torch.Tensor:
        prefix = None
        if part.prefix_blocks:
            assert part.metadata is not None
            packed = self._packed_prefix(layer, part, k_pages, v_pages, q.dtype, workspace)
            prefix = cascade_prefix_state(q, k_pages, v_pages, part.metadata, part.prefix_blocks,
                                          scale, workspace, part.prefix_first_block, packed)
        return self.kernel.write_and_decode(
            q, k, v, part.slots, k_pages, v_pages, part.block_tables, part.table_rows,
            part.kv_lens, scale, first_block=part.prefix_blocks, prefix=prefix,
        )

    def _packed_prefix(self, layer: int, part: DecodePart, k_pages: torch.Tensor,
                       v_pages: torch.Tensor, dtype: torch.dtype,
                       workspace: Workspace) -> PackedKV | None:
        """The part's prefix packed for the flash kernel: kept from an earlier step, or packed
        now and kept; None when the part's prefix is not kept (no key)."""
        if self.packs is None or part.prefix_key is None:
            return None
        packed = self.packs.get(layer, part.prefix_key)
        if packed is None:
            assert part.metadata is not None
            k_prefix, v_prefix = prefix_kv(k_pages, v_pages, part.metadata, part.prefix_blocks,
                                           dtype, workspace, part.prefix_first_block)
            packed = pack_kv(k_prefix[None], v_prefix[None])
            if packed is not None:
                self.packs.put(layer, part.prefix_key, packed)
        return packed


def _keyed(part: DecodePart, packs: PrefixPacks, kv_cache: PagedKVCache) -> DecodePart:
    """The part with its prefix's PrefixPacks key (unchanged without a prefix)."""
    if not part.prefix_blocks or part.metadata is None:
        return part
    block_ids = part.metadata.block_tables[0, :part.prefix_blocks].tolist()
    key = packs.key(kv_cache.k_pages[0], kv_cache.dtype, block_ids)
    return dataclasses.replace(part, prefix_key=key)


def _cascade_part(rows: torch.Tensor | None, metadata: AttentionMetadata, prefix_blocks: int,
                  first_block: int | None) -> DecodePart:
    prefix_len = prefix_blocks * metadata.block_size
    kv_lens = torch.tensor([n - prefix_len for n in metadata.seq_lens], dtype=torch.int64)
    return DecodePart(rows, metadata.slot_mapping, metadata.block_tables, None, kv_lens,
                      prefix_blocks, first_block, metadata)


def _plain_part(rows: torch.Tensor | None, plan: StepPlan,
                slots: torch.Tensor) -> DecodePart | None:
    """The part of a plan without cascade, or None when it has one (not served here)."""
    if plan.cascade_blocks or plan.groups or plan.decode_windowed or plan.decode_seq_lens is None:
        return None
    return DecodePart(rows, slots, plan.block_tables, plan.decode_table_rows,
                      plan.decode_seq_lens, 0, None, None)


def _int64_contiguous(part: DecodePart) -> bool:
    """The kernel reads these as raw int64 arrays."""
    read = [t for t in (part.slots, part.block_tables, part.table_rows, part.kv_lens)
            if t is not None]
    return all(t.dtype == torch.int64 and t.is_contiguous() for t in read)
