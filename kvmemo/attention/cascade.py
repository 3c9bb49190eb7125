"""Cascade (shared-prefix) attention: attend to a prefix every sequence shares once, then merge.

Concept: when all sequences of a step start with the same physical blocks (a prefix-cache hit on
one system prompt), attention splits exactly into two parts over disjoint key sets:
  prefix: every query against the shared keys [0, prefix_len), gathered ONCE, one batched call;
  suffix: each sequence's own keys [prefix_len, seq_len), causal for its new tokens.
Each part returns its output and per-row log-sum-exp (lse); the merge reweights them, in fp32:
  out = (o_p * e^(lse_p - m) + o_s * e^(lse_s - m)) / (e^(lse_p - m) + e^(lse_s - m))
      = o_s + (o_p - o_s) * sigmoid(lse_p - lse_s).

Invariant: used only when every sequence has already cached the whole prefix
(num_computed_tokens >= prefix_len), so every query sees every prefix key without a mask and
every suffix holds at least the sequence's new tokens (>= 1 key). Then the result equals
torch_ref.paged_attention_ref to float tolerance.
"""

from __future__ import annotations

from typing import cast

import torch

from kvmemo.attention.cache import gather_pages
from kvmemo.attention.kernels.flash_attention import (
    PackedKV,
    flash_attention_packed,
)
from kvmemo.attention.kernels.paged_decode import load_decode_kernel
from kvmemo.attention.lse_attention import (
    attention_with_lse_upto,
    fold_query_groups,
    merge_attention_states,
    unfold_query_groups,
)
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.attention.workspace import Workspace

# When cascade pays (CPU, Hq=9, Hkv=3, D=64, fp32, min-of-25 A/B against the per-sequence
# gather): it adds ~100-150 us of fixed work (a second attention call, masks, merge) and saves
# gathering the prefix once per extra sequence. Break-even seen near prefix 64-128 tokens at
# 32 sequences and ~900 saved tokens at 8; at 32 x 1,024 it is ~5-10x faster. Read at call time,
# so tests can lower them.
MIN_PREFIX_TOKENS = 128
MIN_SAVED_TOKENS = 768  # (num_seqs - 1) * prefix_len: prefix K/V rows no longer gathered


def common_prefix_blocks(block_tables: torch.Tensor, max_blocks: int) -> int:
    """Leading columns (at most max_blocks) of block_tables [S, maxb] equal in every row."""
    tables = block_tables[:, :max_blocks]  # [S, nb]
    same = (tables == tables[:1]).all(dim=0)  # [nb] column c identical across sequences
    return int(same.cumprod(dim=0).sum())  # length of the leading all-True run


def cascade_prefix_blocks(metadata: AttentionMetadata) -> int:
    """P, the shared blocks cascade attention should use this step, or 0 to not use it.

    P is the longest run of leading block ids shared by every sequence AND fully cached by every
    sequence (capped at min(num_computed_tokens) // block_size), so the prefix needs no mask.
    """
    block_size = metadata.block_size
    min_computed = min((s - q for s, q in zip(metadata.seq_lens, metadata.query_lens)), default=0)
    if min_computed < block_size or not _pays_off(metadata.num_seqs, min_computed):
        return 0  # cheap exit before touching tensors
    prefix_blocks = common_prefix_blocks(metadata.block_tables, min_computed // block_size)
    return (
        prefix_blocks
        if prefix_blocks and _pays_off(metadata.num_seqs, prefix_blocks * block_size)
        else 0
    )


def _pays_off(num_seqs: int, prefix_len: int) -> bool:
    return (
        num_seqs >= 2
        and prefix_len >= MIN_PREFIX_TOKENS
        and (num_seqs - 1) * prefix_len >= MIN_SAVED_TOKENS
    )


def contiguous_run_start(block_ids: torch.Tensor) -> int | None:
    """block_ids[0] when the ids ascend by exactly one (their pages lie back to back), else None."""
    if block_ids.numel() == 0:
        return None
    if block_ids.numel() > 1 and not bool((block_ids[1:] - block_ids[:-1] == 1).all()):
        return None
    return int(block_ids[0])


def cascade_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    prefix_blocks: int,
    scale: float,
    workspace: Workspace | None = None,
    prefix_first_block: int | None = None,
) -> torch.Tensor:
    """Attention of the whole batch with the first prefix_blocks blocks shared. Returns [T, Hq, D].

    k_cache/v_cache are logical [num_blocks, bs, Hkv, D] views; pages are read head-major.
    prefix_first_block (see contiguous_run_start) lets the prefix be read in place, no gather.
    """
    workspace = workspace or Workspace()
    k_pages, v_pages = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)  # [Hkv, nb, bs, D]
    o_prefix, lse_prefix = cascade_prefix_state(
        q, k_pages, v_pages, metadata, prefix_blocks, scale, workspace, prefix_first_block
    )
    o_suffix, lse_suffix = _suffix_attention(
        q, k_pages, v_pages, metadata, prefix_blocks, scale, workspace
    )
    return merge_attention_states(o_prefix, lse_prefix, o_suffix, lse_suffix).to(q.dtype)


def cascade_prefix_state(
    q: torch.Tensor,  # [T, Hq, D]
    k_pages: torch.Tensor,  # [Hkv, num_blocks, bs, D]
    v_pages: torch.Tensor,
    metadata: AttentionMetadata,
    prefix_blocks: int,
    scale: float,
    workspace: Workspace,
    prefix_first_block: int | None = None,
    packed: PackedKV | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query against the shared prefix's keys, no mask: o [T, Hq, D] and lse [T, Hq],
    fp32 contiguous (what a merge, or the decode kernel as its starting state, takes).
    `packed`: the prefix's K/V packed by kernels.flash_attention.pack_kv (read instead of the
    pages)."""
    result = None if packed is None else _prefix_attention(q, None, None, scale, packed)
    if result is None:
        k_prefix, v_prefix = prefix_kv(
            k_pages, v_pages, metadata, prefix_blocks, q.dtype, workspace, prefix_first_block
        )
        result = _prefix_attention(q, k_prefix, v_prefix, scale)
        assert result is not None  # unpacked keys always have a path (torch's kernel)
    o, lse = result
    return o.float().contiguous(), lse.float().contiguous()


def prefix_kv(
    k_pages: torch.Tensor,  # [Hkv, num_blocks, bs, D]
    v_pages: torch.Tensor,
    metadata: AttentionMetadata,
    prefix_blocks: int,
    dtype: torch.dtype,
    workspace: Workspace,
    prefix_first_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared prefix's keys and values [Hkv, Lp, D] in `dtype`: a view of the pages when
    its blocks are consecutive, else gathered."""
    if prefix_first_block is not None and k_pages.dtype == dtype:
        # A prefix computed on a fresh pool usually got consecutive blocks: a view of its pages
        # saves copying every prefix key and value in every layer of every step.
        blocks = slice(prefix_first_block, prefix_first_block + prefix_blocks)
        return k_pages[:, blocks].flatten(1, 2), v_pages[:, blocks].flatten(1, 2)  # strided
    prefix_ids = metadata.block_tables[0, :prefix_blocks]
    return (gather_pages(k_pages, prefix_ids, dtype, "cascade_k", workspace),
            gather_pages(v_pages, prefix_ids, dtype, "cascade_v", workspace))


def _prefix_attention(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float,
    packed: PackedKV | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """All T queries against the shared keys, no mask. q: [T, Hq, D]; k, v: [Hkv, Lp, D], or
    `packed` (their packed form; None comes back where the kernel cannot read it).

    Returns o [T, Hq, D] and lse [T, Hq] (fp32).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = packed.shape[1] if packed is not None else cast(torch.Tensor, k).shape[0]
    group = num_heads // num_kv_heads
    # [T, Hkv, G, D] -> [1, Hkv, T * G, D]: row t * G + g is token t of head h * G + g.
    qg = q.view(num_tokens, num_kv_heads, group, head_dim).transpose(0, 1)
    qg = qg.reshape(1, num_kv_heads, num_tokens * group, head_dim)
    if packed is not None:
        result = flash_attention_packed(qg, packed, scale)
        if result is None:
            return None
        o, lse = result
    else:
        assert k is not None and v is not None
        o, lse = attention_with_lse_upto(qg, k[None], v[None], None, scale)
    o = o.view(num_kv_heads, num_tokens, group, head_dim).transpose(0, 1)
    lse = lse.view(num_kv_heads, num_tokens, group).transpose(0, 1)
    return o.reshape(num_tokens, num_heads, head_dim), lse.reshape(num_tokens, num_heads)


def _suffix_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,  # [Hkv, num_blocks, bs, D]
    v_pages: torch.Tensor,
    metadata: AttentionMetadata,
    prefix_blocks: int,
    scale: float,
    workspace: Workspace,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence against its own keys [prefix_len, seq_len).

    Returns o [T, Hq, D], lse [T, Hq].
    """
    num_tokens, num_heads, _ = q.shape
    decode = [s for s, n in enumerate(metadata.query_lens) if n == 1]
    if len(decode) == metadata.num_seqs:
        return _batched_decode_suffix(
            q, k_pages, v_pages, metadata, decode, prefix_blocks, scale, workspace
        )
    out = torch.empty_like(q)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    prefix_len = prefix_blocks * metadata.block_size
    if decode:
        rows = torch.tensor([metadata.query_start_loc[s] for s in decode], device=q.device)
        o_d, lse_d = _batched_decode_suffix(
            q.index_select(0, rows), k_pages, v_pages, metadata, decode, prefix_blocks, scale,
            workspace,
        )
        out[rows], lse[rows] = o_d, lse_d
    chunks = [s for s, n in enumerate(metadata.query_lens) if n > 1]
    if _batch_pays_off(metadata, chunks, prefix_len):
        _batched_prefill_suffix(
            q, k_pages, v_pages, metadata, chunks, prefix_blocks, scale, workspace, out, lse
        )
        return out, lse
    for s in chunks:
        start, end = metadata.query_start_loc[s], metadata.query_start_loc[s + 1]
        suffix_len = metadata.seq_lens[s] - prefix_len
        suffix_blocks = -(-suffix_len // metadata.block_size)
        table = metadata.block_tables[s, prefix_blocks : prefix_blocks + suffix_blocks]
        # [Hkv, Ls, D]
        k = gather_pages(k_pages, table, q.dtype, "cascade_sk", workspace)[:, :suffix_len]
        v = gather_pages(v_pages, table, q.dtype, "cascade_sv", workspace)[:, :suffix_len]
        out[start:end], lse[start:end] = _prefill_suffix(q[start:end], k, v, scale)
    return out, lse


def _batched_decode_suffix(
    q: torch.Tensor,  # [B, Hq, D], one query per decode sequence
    k_pages: torch.Tensor,  # [Hkv, num_blocks, bs, D]
    v_pages: torch.Tensor,
    metadata: AttentionMetadata,
    decode: list[int],
    prefix_blocks: int,
    scale: float,
    workspace: Workspace,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode query against its suffix blocks only. Returns [B, Hq, D], [B, Hq].

    CPU: the compiled kernel reads the suffix pages in place; otherwise a padded gather of the
    suffix blocks and one masked attention call.
    """
    num_kv_heads, _, block_size, head_dim = k_pages.shape
    batch, num_heads = q.shape[0], q.shape[1]
    group = num_heads // num_kv_heads
    prefix_len = prefix_blocks * block_size
    suffix_lens = [metadata.seq_lens[s] - prefix_len for s in decode]
    kernel = load_decode_kernel() if q.device.type == "cpu" else None
    if kernel is not None and kernel.supports(q, k_pages, v_pages):
        table_rows = None if batch == metadata.num_seqs else torch.tensor(decode)
        o, lse = kernel(
            q, k_pages, v_pages, metadata.block_tables, table_rows, prefix_blocks,
            torch.tensor(suffix_lens), scale, with_lse=True,
        )
        assert lse is not None
        return o, lse
    num_blocks = -(-max(suffix_lens) // block_size)
    rows = metadata.block_tables if batch == metadata.num_seqs else metadata.block_tables[decode]
    tables = rows[:, prefix_blocks : prefix_blocks + num_blocks]  # [B, nb]
    length = num_blocks * block_size
    ids = tables.reshape(-1)  # [B * nb]
    # [Hkv, B * Ls, D] -> [B, Hkv, Ls, D]
    k = gather_pages(k_pages, ids, q.dtype, "cascade_dk", workspace)
    v = gather_pages(v_pages, ids, q.dtype, "cascade_dv", workspace)
    k = k.view(num_kv_heads, batch, length, head_dim).transpose(0, 1)
    v = v.view(num_kv_heads, batch, length, head_dim).transpose(0, 1)
    last_key = torch.tensor(suffix_lens, device=q.device)[:, None].expand(batch, group) - 1
    qg = q.view(batch, num_kv_heads, group, head_dim)  # heads h*G..h*G+G-1 share kv head h
    o, lse = attention_with_lse_upto(qg, k, v, last_key, scale)  # [B, Hkv, G, D], [B, Hkv, G]
    return o.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)


def _batch_pays_off(metadata: AttentionMetadata, chunks: list[int], prefix_len: int) -> bool:
    """One padded call for all prefill chunks when padding at most doubles the score matrix:
    it replaces one attention call (and its fixed cost, ~0.3-0.5 ms here) per sequence."""
    if len(chunks) < 2:
        return False
    query_lens = [metadata.query_lens[s] for s in chunks]
    suffix_lens = [metadata.seq_lens[s] - prefix_len for s in chunks]
    padded = len(chunks) * max(query_lens) * max(suffix_lens)
    return padded <= 2 * sum(q * k for q, k in zip(query_lens, suffix_lens))


def _batched_prefill_suffix(
    q: torch.Tensor,  # [T, Hq, D], every sequence's rows
    k_pages: torch.Tensor,  # [Hkv, num_blocks, bs, D]
    v_pages: torch.Tensor,
    metadata: AttentionMetadata,
    chunks: list[int],  # sequences with more than one query
    prefix_blocks: int,
    scale: float,
    workspace: Workspace,
    out: torch.Tensor,  # [T, Hq, D], written at the chunks' rows
    lse: torch.Tensor,  # [T, Hq]
) -> None:
    """Every prefill chunk against its own suffix keys in one causal, padded attention call.

    Sequence b's queries sit at rows [0, Lq_b) of its padded block and its keys at [0, Ls_b);
    query i sees keys j <= Ls_b - Lq_b + i. Padded query rows see key 0 only (always valid) and
    are discarded.
    """
    num_kv_heads, _, block_size, head_dim = k_pages.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    prefix_len = prefix_blocks * block_size
    batch = len(chunks)
    query_lens = torch.tensor([metadata.query_lens[s] for s in chunks])  # [B]
    suffix_lens = torch.tensor([metadata.seq_lens[s] - prefix_len for s in chunks])  # [B]
    max_q, max_s = int(query_lens.max()), int(suffix_lens.max())
    num_blocks = -(-max_s // block_size)
    tables = metadata.block_tables[chunks][:, prefix_blocks : prefix_blocks + num_blocks]  # [B, nb]
    length = num_blocks * block_size
    # [Hkv, B * L, D] -> [B, Hkv, L, D]; blocks past a sequence's suffix are masked out below.
    k = gather_pages(k_pages, tables.reshape(-1), q.dtype, "cascade_pk", workspace)
    v = gather_pages(v_pages, tables.reshape(-1), q.dtype, "cascade_pv", workspace)
    k = k.view(num_kv_heads, batch, length, head_dim).transpose(0, 1)
    v = v.view(num_kv_heads, batch, length, head_dim).transpose(0, 1)
    # Queries, padded: qp [B, max_q, Hq, D] -> [B, Hkv, G * max_q, D], row g * max_q + i.
    starts = torch.tensor([metadata.query_start_loc[s] for s in chunks])
    row = torch.arange(max_q)
    in_chunk = row[None, :] < query_lens[:, None]  # [B, max_q]
    rows = (starts[:, None] + row[None, :]).masked_fill(~in_chunk, 0)  # [B, max_q]
    # Chunks of one length, one after another in the batch (a burst of prompts on one prefix):
    # no padding, so their rows are one slice of q and of out, read and written in place.
    first = int(starts[0])
    unpadded = bool(in_chunk.all()) and int(starts[-1]) == first + (batch - 1) * max_q
    if unpadded:
        qp = q[first : first + batch * max_q]
    else:
        qp = q.index_select(0, rows.reshape(-1).to(q.device))
    qp = qp.view(batch, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qp = qp.reshape(batch, num_kv_heads, group * max_q, head_dim)
    last_key = (suffix_lens - query_lens)[:, None] + row[None, :]  # [B, max_q]
    last_key = last_key.masked_fill(~in_chunk, 0).repeat(1, group)  # [B, G * max_q]
    o, lse_p = attention_with_lse_upto(qp, k, v, last_key, scale)  # [B, Hkv, G*max_q, D], [..]
    o = o.view(batch, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    lse_p = lse_p.view(batch, num_kv_heads, group, max_q).permute(0, 3, 1, 2)
    if unpadded:
        span = slice(first, first + batch * max_q)
        out[span].view(batch, max_q, num_kv_heads, group, head_dim).copy_(o)
        lse[span].view(batch, max_q, num_kv_heads, group).copy_(lse_p)
        return
    keep = in_chunk.reshape(-1).to(q.device)
    dest = rows.reshape(-1)[in_chunk.reshape(-1)].to(q.device)
    out[dest] = o.reshape(batch * max_q, num_heads, head_dim)[keep].to(out.dtype)
    lse[dest] = lse_p.reshape(batch * max_q, num_heads)[keep]


def _prefill_suffix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [Lq, Hq, D]; k, v: [Hkv, Ls, D], the last Lq keys being the queries' own. Causal."""
    query_len, num_heads, _ = q.shape
    num_kv_heads, suffix_len = k.shape[0], k.shape[1]
    q_pos = torch.arange(suffix_len - query_len, suffix_len, device=q.device)  # causal
    o, lse = attention_with_lse_upto(
        fold_query_groups(q, num_kv_heads), k[None], v[None],
        q_pos.repeat(num_heads // num_kv_heads), scale,
    )  # [1, Hkv, G * Lq, D], [1, Hkv, G * Lq]
    lse = lse.view(num_kv_heads, -1, query_len).permute(2, 0, 1)
    return unfold_query_groups(o, query_len), lse.reshape(query_len, num_heads)
