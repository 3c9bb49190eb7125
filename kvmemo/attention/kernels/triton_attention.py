"""Paged attention and the KV write in Triton: one source for the GPU and for Triton's interpreter.

Under TRITON_INTERPRET=1 (set before this module is imported) the kernels run on CPU tensors in
NumPy, which is how `make test` checks them on a machine without a GPU. The torch reference
(attention/torch_ref.py) is the oracle.

Invariant (batch invariance): a query's output depends only on its own sequence (its length,
position, keys), never on the batch around it or on how the launch was split. Keys are cut into
fixed segments of SEGMENT positions; each segment's softmax state starts from scratch and the
states are merged in segment order by one function (`_merge`), whether the merge runs in
registers (one program per query tile) or in a second kernel over stored partial states (split
mode, for small batches that would leave the GPU idle). A tile's other rows never enter a row's
arithmetic. So decode and prefill, batch 1 and batch 64, split or not, give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton_support.triton_unavailable_reason says why nothing here runs
    triton = None
    tl = None

from kvmemo.triton_dot import interpreted_dot
from kvmemo.triton_support import interpreting

INTERPRETING = interpreting()  # fixed at import, as Triton fixes it when the kernels are defined
SEGMENT = 256  # key positions per softmax segment; a multiple of every supported block size
MAX_BLOCK_SIZE = SEGMENT


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def rows_per_tile(group: int, device: torch.device) -> int:
    """BLOCK_M: query rows (tokens x the group's query heads) one program handles.

    tl.dot needs at least 16 rows; on a GPU 64 keeps the tensor cores busy in prefill. Fixed per
    device and group, never per batch, so a row's arithmetic is the same in every launch.
    """
    floor = 64 if device.type == "cuda" else 16
    return max(floor, _next_power_of_2(group))


def keys_per_step(block_size: int, device: torch.device) -> int:
    """Keys one online-softmax step reads (whole pages): at least tl.dot's 16, 64 on a GPU.
    Fixed per device and block size, never per batch: part of a row's arithmetic order."""
    return max(block_size, 64 if device.type == "cuda" else 16)


if triton is not None:
    # A finite "minus infinity": rows whose keys are all masked stay finite (see _merge).
    _NEG = tl.constexpr(-1.0e30)

    @triton.jit
    def _write_pages_kernel(
        k_ptr, v_ptr, k_pages_ptr, v_pages_ptr, slot_ptr, num_tokens,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_ph,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        """pages[h, slot[t], :] = x[t, h, :] for BLOCK_T tokens of one kv head, K and V;
        a negative slot is skipped (padding)."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.program_id(1).to(tl.int64)
        t_ok = t < num_tokens
        slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        ok = (t_ok & (slot >= 0))[:, None] & (d < HEAD_DIM)[None, :]
        dst = h * stride_ph + slot[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + t[:, None] * stride_kt + h * stride_kh + d[None, :], mask=ok)
        tl.store(k_pages_ptr + dst, k, mask=ok)
        v = tl.load(v_ptr + t[:, None] * stride_vt + h * stride_vh + d[None, :], mask=ok)
        tl.store(v_pages_ptr + dst, v, mask=ok)

    @triton.jit
    def _merge(m_run, l_run, acc_run, m, l_sum, acc):
        """Fold one segment's softmax state (m, l_sum, acc) into the running one. The only merge:
        in registers and in the split reduction alike, so both give the same bits."""
        m_new = tl.maximum(m_run, m)
        a = tl.exp(m_run - m_new)
        b = tl.exp(m - m_new)
        return m_new, l_run * a + l_sum * b, acc_run * a[:, None] + acc * b[:, None]

    @triton.jit
    def _tile_rows(
        tile, kvh, tile_seq_ptr, tile_q0_ptr, q_start_ptr, q_len_ptr, seq_len_ptr,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        """Where the tile's rows are: row r is query token q0 + r // GROUP of the tile's sequence,
        query head kvh * GROUP + r % GROUP."""
        seq = tl.load(tile_seq_ptr + tile)
        q0 = tl.load(tile_q0_ptr + tile)
        q_len = tl.load(q_len_ptr + seq)
        seq_len = tl.load(seq_len_ptr + seq)
        first_row = tl.load(q_start_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        tok = q0 + rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = (rows < (BLOCK_M // GROUP) * GROUP) & (tok < q_len)
        q_pos = seq_len - q_len + tok  # absolute position of each row's query
        return seq, q0, q_len, seq_len, first_row + tok, head, row_ok, q_pos

    @triton.jit
    def _segment_state(
        q, q_pos, seq, kvh, k_ptr, v_ptr, tables_ptr, stride_table, stride_ph, stride_pb,
        seg_lo, seg_hi, window, scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr, HAS_WINDOW: tl.constexpr,
        INTERPRETED: tl.constexpr, FP32_DOT: tl.constexpr,
    ):
        """Softmax state of every row over keys [seg_lo, seg_hi), from scratch, KEYS at a time
        (KEYS / BLOCK_SIZE pages, each found through the block table)."""
        m = tl.full([BLOCK_M], _NEG, tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, KEYS)
        d_ok = d < HEAD_DIM
        head_base = kvh.to(tl.int64) * stride_ph
        for tile in range(seg_lo // KEYS, tl.cdiv(seg_hi, KEYS)):
            key_pos = tile * KEYS + n
            in_range = key_pos < seg_hi
            block = tl.load(tables_ptr + seq * stride_table + key_pos // BLOCK_SIZE,
                            mask=in_range, other=0).to(tl.int64)
            offsets = (head_base + block[:, None] * stride_pb
                       + (key_pos % BLOCK_SIZE)[:, None] * HEAD_DIM + d[None, :])
            kv_mask = in_range[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0)
            k = k.to(q.dtype)  # fp8 and fp32 pages are read in the query's dtype
            v = v.to(q.dtype)
            if INTERPRETED:  # fp32, each row's sums its own (kvmemo/triton_dot.py)
                s = interpreted_dot(q, tl.trans(k))
            elif FP32_DOT:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            visible = (key_pos[None, :] <= q_pos[:, None]) & in_range[None, :]
            if HAS_WINDOW:
                visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, _NEG)
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            # P stays fp32: bf16 V is exact in tf32, so P.V on tf32 tensor cores loses only P's
            # 13 low mantissa bits, where flash attention's bf16 P loses 16 (fp32: exact).
            if INTERPRETED:
                pv = interpreted_dot(p, v)
            elif FP32_DOT:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p, v.to(tl.float32), input_precision="tf32")
            acc = acc * alpha[:, None] + pv
            m = m_new
        return m, l_sum, acc

    @triton.jit
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr,
        tile_seq_ptr, tile_q0_ptr, q_start_ptr, q_len_ptr, seq_len_ptr,
        part_m_ptr, part_l_ptr, part_acc_ptr,
        scale, window, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_ph, stride_pb, stride_table,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr, SEG: tl.constexpr,
        SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, INTERPRETED: tl.constexpr,
        FP32_DOT: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        seq, q0, q_len, seq_len, q_row, head, row_ok, q_pos = _tile_rows(
            tile, kvh, tile_seq_ptr, tile_q0_ptr, q_start_ptr, q_len_ptr, seq_len_ptr,
            GROUP, BLOCK_M,
        )
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        io_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(
            q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=io_mask, other=0.0,
        )
        # Keys the tile's rows can see: [lo, hi).
        first_pos = seq_len - q_len + q0
        hi = seq_len - q_len + tl.minimum(q0 + BLOCK_M // GROUP, q_len)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(first_pos - window + 1, 0)
        if SPLIT:
            split = tl.program_id(2)
            seg_lo = tl.maximum(split * SEG, lo)
            seg_hi = tl.minimum(split * SEG + SEG, hi)
            m = tl.full([BLOCK_M], _NEG, tl.float32)
            l_sum = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            if seg_lo < seg_hi:
                m, l_sum, acc = _segment_state(
                    q, q_pos, seq, kvh, k_ptr, v_ptr, tables_ptr, stride_table, stride_ph,
                    stride_pb, seg_lo, seg_hi, window, scale, HEAD_DIM, BLOCK_D, BLOCK_M,
                    BLOCK_SIZE, KEYS, HAS_WINDOW, INTERPRETED, FP32_DOT,
                )
            part = ((tile * tl.num_programs(1) + kvh) * num_splits + split).to(tl.int64)
            rows = tl.arange(0, BLOCK_M)
            tl.store(part_m_ptr + part * BLOCK_M + rows, m)
            tl.store(part_l_ptr + part * BLOCK_M + rows, l_sum)
            tl.store(
                part_acc_ptr + (part * BLOCK_M + rows[:, None]) * BLOCK_D + d[None, :], acc
            )
        else:
            m_run = tl.full([BLOCK_M], _NEG, tl.float32)
            l_run = tl.zeros([BLOCK_M], tl.float32)
            acc_run = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for segment in range(lo // SEG, tl.cdiv(hi, SEG)):
                seg_lo = tl.maximum(segment * SEG, lo)
                seg_hi = tl.minimum(segment * SEG + SEG, hi)
                m, l_sum, acc = _segment_state(
                    q, q_pos, seq, kvh, k_ptr, v_ptr, tables_ptr, stride_table, stride_ph,
                    stride_pb, seg_lo, seg_hi, window, scale, HEAD_DIM, BLOCK_D, BLOCK_M,
                    BLOCK_SIZE, KEYS, HAS_WINDOW, INTERPRETED, FP32_DOT,
                )
                m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m, l_sum, acc)
            out = acc_run / l_run[:, None]
            tl.store(
                out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty), mask=io_mask,
            )

    @triton.jit
    def _reduce_kernel(
        out_ptr, tile_seq_ptr, tile_q0_ptr, q_start_ptr, q_len_ptr, seq_len_ptr,
        part_m_ptr, part_l_ptr, part_acc_ptr, num_splits, stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Merge the split mode's partial states, in segment order, into the output."""
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        _, _, _, _, q_row, head, row_ok, _ = _tile_rows(
            tile, kvh, tile_seq_ptr, tile_q0_ptr, q_start_ptr, q_len_ptr, seq_len_ptr,
            GROUP, BLOCK_M,
        )
        rows = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        m_run = tl.full([BLOCK_M], _NEG, tl.float32)
        l_run = tl.zeros([BLOCK_M], tl.float32)
        acc_run = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        base = (tile * tl.num_programs(1) + kvh).to(tl.int64) * num_splits
        for split in range(num_splits):
            part = base + split
            m = tl.load(part_m_ptr + part * BLOCK_M + rows)
            l_sum = tl.load(part_l_ptr + part * BLOCK_M + rows)
            acc = tl.load(part_acc_ptr + (part * BLOCK_M + rows[:, None]) * BLOCK_D + d[None, :])
            m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m, l_sum, acc)
        out = acc_run / l_run[:, None]
        mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
        tl.store(
            out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=mask,
        )


def write_pages(
    k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """pages [Hkv, num_blocks, bs, D] (contiguous) <- k, v [T, Hkv, D] at slot_mapping [T].

    k and v must already be in the pages' dtype (an fp8 cache's values quantised by the caller,
    which keeps one rounding rule for every backend); negative slots are skipped.
    """
    num_kv_heads, _, _, head_dim = k_pages.shape
    for x, pages in ((k, k_pages), (v, v_pages)):
        if x.dtype != pages.dtype or not pages.is_contiguous() or x.stride(-1) != 1:
            raise ValueError(
                f"write_pages needs k and v in the pages' dtype {pages.dtype} with unit last "
                f"stride and contiguous pages, got {x.dtype} with strides {x.stride()}"
            )
    if k_pages.dtype == torch.float8_e4m3fn:  # the same bytes; plain loads and stores move them
        k_pages, v_pages = k_pages.view(torch.uint8), v_pages.view(torch.uint8)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    block_t = 16
    _write_pages_kernel[(triton.cdiv(num_tokens, block_t), num_kv_heads)](
        k, v, k_pages, v_pages, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_pages.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=_next_power_of_2(head_dim), BLOCK_T=block_t,
    )


@dataclass(frozen=True)
class TilePlan:
    """How one step's queries are cut into tiles of BLOCK_M rows, on the device."""

    block_m: int
    tokens_per_tile: int
    tile_seq: torch.Tensor  # [n_tiles] int32: the sequence of each tile
    tile_q0: torch.Tensor  # [n_tiles] int32: its first query token within that sequence
    query_start: torch.Tensor  # [S] int32: each sequence's first row in the step's batch
    query_lens: torch.Tensor  # [S] int32
    seq_lens: torch.Tensor  # [S] int32
    num_segments: int  # segments of the longest sequence: the split mode's third grid axis

    @property
    def num_tiles(self) -> int:
        return int(self.tile_seq.shape[0])

    @classmethod
    def build(
        cls, query_lens: list[int], seq_lens: list[int], group: int, device: torch.device
    ) -> TilePlan:
        block_m = rows_per_tile(group, device)
        per_tile = block_m // group
        tile_seq: list[int] = []
        tile_q0: list[int] = []
        starts: list[int] = []
        row = 0
        for s, n in enumerate(query_lens):
            starts.append(row)
            row += n
            for q0 in range(0, n, per_tile):
                tile_seq.append(s)
                tile_q0.append(q0)

        def on_device(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        return cls(
            block_m=block_m,
            tokens_per_tile=per_tile,
            tile_seq=on_device(tile_seq),
            tile_q0=on_device(tile_q0),
            query_start=on_device(starts),
            query_lens=on_device(list(query_lens)),
            seq_lens=on_device(list(seq_lens)),
            num_segments=max(1, -(-max(seq_lens, default=1) // SEGMENT)),
        )


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    plan: TilePlan,
    scale: float,
    sliding_window: int | None = None,
    split: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over head-major pages [Hkv, num_blocks, bs, D] -> [T, Hq, D].

    The step's K/V must already be in the pages. `split` runs one program per (tile, kv head,
    segment) and a reduction; the result is the same bits either way (see the module docstring).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    block_d = _next_power_of_2(head_dim)
    fp32 = q.dtype == torch.float32
    grid_splits = plan.num_segments if split else 1
    if split:
        parts = plan.num_tiles * num_kv_heads * grid_splits * plan.block_m
        part_m = torch.empty(parts, dtype=torch.float32, device=q.device)
        part_l = torch.empty(parts, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(parts * block_d, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused: SPLIT=False never touches them
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=plan.block_m)
    _attention_kernel[(plan.num_tiles, num_kv_heads, grid_splits)](
        q, k_pages, v_pages, out, block_tables,
        plan.tile_seq, plan.tile_q0, plan.query_start, plan.query_lens, plan.seq_lens,
        part_m, part_l, part_acc,
        scale, sliding_window or 0, grid_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pages.stride(0), k_pages.stride(1), block_tables.stride(0),
        BLOCK_SIZE=block_size, KEYS=keys_per_step(block_size, q.device), SEG=SEGMENT,
        SPLIT=split, HAS_WINDOW=sliding_window is not None,
        INTERPRETED=INTERPRETING, FP32_DOT=fp32, **common,
    )
    if split:
        _reduce_kernel[(plan.num_tiles, num_kv_heads)](
            out, plan.tile_seq, plan.tile_q0, plan.query_start, plan.query_lens, plan.seq_lens,
            part_m, part_l, part_acc, grid_splits, out.stride(0), out.stride(1), **common,
        )
    return out
