"""Fast paged attention over head-major pages.

All decodes run in one batched SDPA, prefills per sequence.

Invariant: equal (to float tolerance) to torch_ref.paged_attention_ref for every batch.
Pages are gathered into reused workspace buffers (never a fresh allocation per layer), laid out
[Hkv, L, D] per sequence so SDPA reads unit-stride rows; K/V heads are shared by grouped-query
heads without repeat copies (decode folds the group into query rows, prefill uses the flash
kernel's native support). Everything that depends only on the step (which sequences decode, the
flattened block ids, masks) lives in a StepPlan built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvmemo.attention.cache import gather_pages
from kvmemo.attention.cascade import (
    cascade_attention,
    cascade_prefix_blocks,
    contiguous_run_start,
)
from kvmemo.attention.kernels.flash_attention import flash_attention
from kvmemo.attention.kernels.paged_decode import load_decode_kernel
from kvmemo.attention.lse_attention import (
    fold_query_groups,
    merge_attention_states,
    unfold_query_groups,
)
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.attention.workspace import Workspace


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with more than one new token (a prompt chunk)."""

    start: int  # first query row
    end: int
    seq_len: int  # keys it attends to (cached + new)
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] its pages, in order
    window: int | None = None  # set when a sliding window hides some of those keys


@dataclass(slots=True)
class CascadeGroup:
    """Sequences sharing `prefix_blocks` cached leading blocks: one cascade call of their own."""

    rows: torch.Tensor  # [T_g] their query rows in the step's batch
    metadata: AttentionMetadata  # theirs alone (AttentionMetadata.subset)
    prefix_blocks: int
    first_block: int | None  # contiguous_run_start of the shared blocks


@dataclass(slots=True)
class RestOfBatch:
    """The sequences in no group, planned on their own."""

    rows: torch.Tensor  # [T_r] their query rows in the step's batch
    plan: StepPlan


@dataclass(slots=True)
class StepPlan:
    """What every layer of one step needs to know about the batch, derived once from metadata."""

    cascade_blocks: int  # > 0: the batch shares this many cached leading blocks (cascade.py)
    # The shared blocks' first id when their ids ascend by one, so their pages lie back to back and
    # attention reads them in place; None: they are gathered.
    cascade_first_block: int | None
    decode_seqs: list[int]  # sequences with exactly one new token
    decode_rows: torch.Tensor | None  # [B] their query rows; None when the whole batch decodes
    decode_block_ids: torch.Tensor | None  # [B * nb] pages of every decode sequence, padded
    decode_num_blocks: int  # nb: pages per decode sequence after padding
    decode_valid: torch.Tensor | None  # [B, 1, 1, nb * bs] bool; None when nothing is padding
    block_tables: torch.Tensor  # [S, max_blocks] the metadata's
    decode_table_rows: torch.Tensor | None  # [B] block_tables row of each decode; None: all rows
    decode_seq_lens: torch.Tensor | None  # [B] keys each decode sequence attends to
    prefills: list[PrefillSeq]
    # A sliding window hides keys of some decode sequence: decode_valid masks them, and the
    # compiled kernel (which reads every key it is given) is not used.
    decode_windowed: bool = False
    # No prefix is shared by the whole batch, but groups of sequences share one each (several
    # system prompts or documents): each group goes through cascade on its own, the rest
    # through this plan's paged paths (see grouped_plan).
    groups: list[CascadeGroup] = field(default_factory=list)
    rest: RestOfBatch | None = None
    _masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, metadata: AttentionMetadata) -> StepPlan:
        return cls._build(metadata, allow_groups=True)

    @classmethod
    def build_ungrouped(cls, metadata: AttentionMetadata) -> StepPlan:
        """A plan without cascade groups (the rest of a grouped batch)."""
        return cls._build(metadata, allow_groups=False)

    @classmethod
    def _build(cls, metadata: AttentionMetadata, allow_groups: bool) -> StepPlan:
        block_size = metadata.block_size
        # The window matters only where a sequence holds more keys than it: a query at (local)
        # position p >= window has keys it must not see.
        window = metadata.sliding_window
        if window is not None and max(metadata.seq_lens, default=0) <= window:
            window = None
        cascade_blocks = 0 if window is not None else cascade_prefix_blocks(metadata)
        if allow_groups and not cascade_blocks and window is None and metadata.num_seqs >= 4:
            grouped = grouped_plan(metadata)
            if grouped is not None:
                return grouped
        cascade_first_block = contiguous_run_start(metadata.block_tables[0, :cascade_blocks])
        decode = [s for s, n in enumerate(metadata.query_lens) if n == 1]
        rows = block_ids = valid = table_rows = decode_lens = None
        num_blocks = 0
        if decode and not cascade_blocks:
            all_decode = len(decode) == metadata.num_seqs
            seq_lens = [metadata.seq_lens[s] for s in decode]
            num_blocks = -(-max(seq_lens) // block_size)
            tables = metadata.block_tables if all_decode else metadata.block_tables[decode]
            block_ids = tables[:, :num_blocks].reshape(-1)  # [B * nb]; padding reads block 0
            windowed = window is not None and max(seq_lens) > window
            if windowed or any(n != num_blocks * block_size for n in seq_lens):
                lens = metadata.seq_lens_t if all_decode else metadata.seq_lens_t[decode]
                positions = torch.arange(num_blocks * block_size, device=lens.device)
                keep = positions[None, :] < lens[:, None]  # [B, L]
                if windowed:  # the query sits at lens - 1 and sees keys > lens - 1 - window
                    assert window is not None
                    keep &= positions[None, :] >= lens[:, None] - window
                valid = keep[:, None, None, :]
            decode_lens = metadata.seq_lens_t
            if not all_decode:
                device = metadata.seq_lens_t.device
                rows = torch.tensor([metadata.query_start_loc[s] for s in decode], device=device)
                table_rows = torch.tensor(decode, device=device)
                decode_lens = metadata.seq_lens_t[table_rows]
        prefills = []
        if not cascade_blocks:
            for s, query_len in enumerate(metadata.query_lens):
                if query_len == 1:
                    continue
                seq_len = metadata.seq_lens[s]
                prefills.append(
                    PrefillSeq(
                        start=metadata.query_start_loc[s],
                        end=metadata.query_start_loc[s + 1],
                        seq_len=seq_len,
                        block_ids=metadata.block_tables[s, : -(-seq_len // block_size)],
                        window=window if window is not None and seq_len > window else None,
                    )
                )
        return cls(
            cascade_blocks, cascade_first_block, decode, rows, block_ids, num_blocks, valid,
            metadata.block_tables, table_rows, decode_lens, prefills,
            decode_windowed=bool(decode) and window is not None,
        )

    def decode_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive mask [B, 1, 1, L] of the decode batch (0 keep, -inf padding).

        Made once per dtype.
        """
        if self.decode_valid is None:
            return None
        mask = self._masks.get(dtype)
        if mask is None:
            mask = torch.zeros(
                self.decode_valid.shape, dtype=dtype, device=self.decode_valid.device
            )
            mask.masked_fill_(~self.decode_valid, float("-inf"))
            self._masks[dtype] = mask
        return mask


def grouped_plan(metadata: AttentionMetadata) -> StepPlan | None:
    """A plan of cascade groups, or None when no group of sequences shares a prefix that pays.

    Sequences are grouped by their first block (equal first blocks: the same cached first
    tokens); a group of at least two whose common cached prefix passes cascade's own test goes
    through cascade alone.
    """
    by_first: dict[int, list[int]] = {}
    for s, first in enumerate(metadata.block_tables[:, 0].tolist()):
        if metadata.seq_lens[s] - metadata.query_lens[s] >= metadata.block_size:  # has a cache
            by_first.setdefault(first, []).append(s)
    groups: list[CascadeGroup] = []
    grouped: set[int] = set()
    for seqs in by_first.values():
        if len(seqs) < 2:
            continue
        sub = metadata.subset(seqs)
        prefix_blocks = cascade_prefix_blocks(sub)
        if not prefix_blocks:
            continue
        first = contiguous_run_start(sub.block_tables[0, :prefix_blocks])
        groups.append(CascadeGroup(metadata.query_rows(seqs), sub, prefix_blocks, first))
        grouped.update(seqs)
    if not groups:
        return None
    others = [s for s in range(metadata.num_seqs) if s not in grouped]
    rest = None
    if others:
        plan = StepPlan.build_ungrouped(metadata.subset(others))
        rest = RestOfBatch(metadata.query_rows(others), plan)
    return StepPlan(
        cascade_blocks=0, cascade_first_block=None, decode_seqs=[], decode_rows=None,
        decode_block_ids=None, decode_num_blocks=0, decode_valid=None,
        block_tables=metadata.block_tables, decode_table_rows=None, decode_seq_lens=None,
        prefills=[], groups=groups, rest=rest,
    )


def grouped_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_pages: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
    v_pages: torch.Tensor,
    plan: StepPlan,
    scale: float,
    workspace: Workspace,
) -> torch.Tensor:
    """Attention of a batch planned in cascade groups (plan.groups) and the rest."""
    k_cache, v_cache = k_pages.permute(1, 2, 0, 3), v_pages.permute(1, 2, 0, 3)  # logical views
    out = torch.empty_like(q)
    for group in plan.groups:
        out[group.rows] = cascade_attention(
            q.index_select(0, group.rows), k_cache, v_cache, group.metadata, group.prefix_blocks,
            scale, workspace, group.first_block,
        ).to(q.dtype)
    if plan.rest is not None:
        out[plan.rest.rows] = paged_attention_pages(
            q.index_select(0, plan.rest.rows), k_pages, v_pages, plan.rest.plan, scale, workspace
        )
    return out


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # logical [num_blocks, block_size, Hkv, D], unscaled values
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Function form over logical caches (any memory layout): cascade or the paged kernels.

    The engine goes through backend.PagedAttentionBackend, which also writes K/V, applies fp8
    scales and builds the StepPlan once per step rather than once per call.
    """
    plan = StepPlan.build(metadata)
    if plan.cascade_blocks:
        return cascade_attention(
            q, k_cache, v_cache, metadata, plan.cascade_blocks, scale, workspace,
            plan.cascade_first_block,
        )
    k_pages, v_pages = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)  # head-major views
    if plan.groups:
        return grouped_attention(q, k_pages, v_pages, plan, scale, workspace or Workspace())
    return paged_attention_pages(q, k_pages, v_pages, plan, scale, workspace or Workspace())


def paged_attention_pages(
    q: torch.Tensor,  # [T, Hq, D] RoPE applied (fp8: already folded by fp8_fold.fold_fp8_query)
    k_pages: torch.Tensor,  # [Hkv, num_blocks, block_size, D], this step's K already written
    v_pages: torch.Tensor,
    plan: StepPlan,
    scale: float,
    workspace: Workspace,
) -> torch.Tensor:
    """Attention of a mixed batch with no shared-prefix cascade. Returns [T, Hq, D] in q's dtype."""
    if plan.decode_seqs and plan.decode_rows is None:  # the whole batch decodes
        return decode_attention(q, k_pages, v_pages, plan, scale, workspace)
    out = torch.empty_like(q)
    if plan.decode_seqs:
        rows = plan.decode_rows
        assert rows is not None  # None only when the whole batch decodes, handled above
        out[rows] = decode_attention(
            q.index_select(0, rows), k_pages, v_pages, plan, scale, workspace
        )
    for seq in plan.prefills:
        out[seq.start : seq.end] = prefill_attention(
            q[seq.start : seq.end], k_pages, v_pages, seq.block_ids, seq.seq_len, scale, workspace,
            seq.window,
        )
    return out


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one query per decode sequence of the plan
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: StepPlan,
    scale: float,
    workspace: Workspace,
) -> torch.Tensor:
    """All decode sequences at once. Returns [B, Hq, D].

    CPU: the compiled kernel reads every page in place (kernels/paged_decode.py). Elsewhere, or
    without a compiler: gather the pages into workspace buffers, then one SDPA padded to the longest
    sequence and masked.
    """
    assert plan.decode_block_ids is not None and plan.decode_seq_lens is not None
    kernel = load_decode_kernel() if q.device.type == "cpu" and not plan.decode_windowed else None
    if kernel is not None and kernel.supports(q, k_pages, v_pages):
        return kernel(
            q, k_pages, v_pages, plan.block_tables, plan.decode_table_rows, 0,
            plan.decode_seq_lens, scale,
        )[0]
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_heads // num_kv_heads
    # [Hkv, B * L, D] -> [B, Hkv, L, D]: each (sequence, head) is an [L, D] unit-stride matrix.
    k = gather_pages(k_pages, plan.decode_block_ids, q.dtype, "decode_k", workspace)
    v = gather_pages(v_pages, plan.decode_block_ids, q.dtype, "decode_v", workspace)
    k = k.view(num_kv_heads, batch, -1, head_dim).transpose(0, 1)
    v = v.view(num_kv_heads, batch, -1, head_dim).transpose(0, 1)
    qg = q.view(batch, num_kv_heads, group, head_dim)  # heads h*G..h*G+G-1 share kv head h
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.decode_mask(q.dtype), scale=scale)
    return o.reshape(batch, num_heads, head_dim)  # [B, Hkv, G, D] -> [B, Hq, D]


def prefill_attention(
    q: torch.Tensor,  # [Lq, Hq, D], the last Lq of seq_len positions
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_ids: torch.Tensor,  # [nb]
    seq_len: int,
    scale: float,
    workspace: Workspace,
    window: int | None = None,
) -> torch.Tensor:
    """Causal among the new tokens, full over the cached ones. Returns [Lq, Hq, D].

    With a window (a sliding layer whose keys outnumber it), one masked SDPA that also hides
    keys more than window - 1 positions back.

    CPU: kvmemo's flash kernel (kernels/flash_attention.py) over cached and new keys at once;
    without it, two mask-free torch flash calls merged by log-sum-exp, the cached keys without a
    mask and the
    new keys with is_causal (which skips the upper triangle): no [Lq, Lk] mask is built and K/V
    heads are shared through the kernel's native grouped-query support. Elsewhere: one masked SDPA.
    """
    query_len, num_heads, _ = q.shape
    num_cached = seq_len - query_len
    # [1, Hkv, Lk, D]
    k = gather_pages(k_pages, block_ids, q.dtype, "prefill_k", workspace)[None, :, :seq_len]
    v = gather_pages(v_pages, block_ids, q.dtype, "prefill_v", workspace)[None, :, :seq_len]
    if q.device.type != "cpu" or window is not None:
        return _masked_prefill(q, k, v, num_cached, scale, window)
    # kvmemo's kernel: grouped row g * Lq + i sees keys up to num_cached + i, cached and new
    # keys in one pass.
    qg = fold_query_groups(q, k.shape[1])
    last_key = torch.arange(num_cached, seq_len).repeat(num_heads // k.shape[1])
    result = flash_attention(qg, k, v, last_key, scale)
    if result is not None:
        return unfold_query_groups(result[0], query_len).to(q.dtype)
    q4 = q.transpose(0, 1)[None]  # [1, Hq, Lq, D]
    o_new, lse_new = _flash_cpu(q4, k[:, :, num_cached:], v[:, :, num_cached:], True, scale)
    if num_cached == 0:
        return o_new[0].transpose(0, 1)
    o_cached, lse_cached = _flash_cpu(q4, k[:, :, :num_cached], v[:, :, :num_cached], False, scale)
    o = merge_attention_states(o_cached, lse_cached, o_new, lse_new).to(q.dtype)  # [1, Hq, Lq, D]
    return o[0].transpose(0, 1)


def _flash_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention with grouped-query heads: o [1, Hq, Lq, D] and fp32 lse [1, Hq, Lq]."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=is_causal, scale=scale
    )[:2]
    return o, lse


def _masked_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_cached: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One SDPA with grouped-query heads folded into query rows and a bottom-right causal mask."""
    query_len, num_heads, _ = q.shape
    num_kv_heads, seq_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    qg = fold_query_groups(q, num_kv_heads)
    q_pos = torch.arange(num_cached, seq_len, device=q.device)
    key_pos = torch.arange(seq_len, device=q.device)[None, :]
    valid = key_pos <= q_pos[:, None]  # [Lq, Lk]
    if window is not None:
        valid &= key_pos > q_pos[:, None] - window
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid.repeat(group, 1), scale=scale)
    return unfold_query_groups(o, query_len)
