"""AttentionMetadata: where each token of one flattened step batch lives in the paged cache.

Invariant: built once per step and validated at the boundary; sequence s owns query rows
query_start_loc[s]:query_start_loc[s+1] and attends to its first seq_lens[s] cached tokens
through block_tables[s]. Sequences are positions in the batch: who they belong to is the
scheduler's business, not attention's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from kvmemo.host_copy import to_device
from kvmemo.kv.layout import first_window_block


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs, validated at construction (see `build`)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, right-padded with 0
    query_start_loc: list[int]  # [num_seqs + 1] prefix sums of query_lens
    query_lens: list[int]  # new tokens per sequence this step (>= 1)
    seq_lens: list[int]  # context length per sequence after this step (cached + new)
    block_size: int
    query_lens_t: torch.Tensor  # [num_seqs] int64 (device copy of query_lens)
    seq_lens_t: torch.Tensor  # [num_seqs] int64 (device copy of seq_lens)
    num_cache_blocks: int = 0  # size of the pool the block ids were checked against
    # Sliding-window layers: a query at position p sees keys p - window < k <= p only. The
    # tables were cropped by `build` to start at the first block any query can still see, so
    # positions here are relative to that block (the window relation does not change).
    sliding_window: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def query_rows(self, seqs: list[int]) -> torch.Tensor:
        """The step-batch rows of sequences `seqs`' queries, in that order."""
        return torch.cat([
            torch.arange(self.query_start_loc[s], self.query_start_loc[s + 1]) for s in seqs
        ]).to(self.slot_mapping.device)

    def subset(self, seqs: list[int]) -> AttentionMetadata:
        """The metadata of sequences `seqs` alone (in that order), their query rows renumbered
        from 0: attention over a sub-batch whose K/V are already written (slot_mapping is
        theirs, but attention does not read it)."""
        query_lens = [self.query_lens[s] for s in seqs]
        query_start_loc = [0]
        for n in query_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        index = torch.tensor(seqs, device=self.block_tables.device)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[self.query_rows(seqs)],
            block_tables=self.block_tables[index],
            query_start_loc=query_start_loc,
            query_lens=query_lens,
            seq_lens=[self.seq_lens[s] for s in seqs],
            block_size=self.block_size,
            query_lens_t=self.query_lens_t[index],
            seq_lens_t=self.seq_lens_t[index],
            num_cache_blocks=self.num_cache_blocks,
            sliding_window=self.sliding_window,
        )

    @classmethod
    def build(
        cls,
        *,
        block_tables: Sequence[Sequence[int | None]],
        num_computed_tokens: list[int],
        query_lens: list[int],
        block_size: int,
        num_cache_blocks: int,
        device: torch.device | str = "cpu",
        sliding_window: int | None = None,
    ) -> AttentionMetadata:
        """Validate the per-sequence lists and derive slot mapping and padded tensors.

        With a sliding_window, each table is first cropped to start at the block holding
        position num_computed - window + 1 (the first key the step's first query sees); entries
        before it may be None (blocks the window no longer needs, already released).

        Raises:
            ValueError: lists of different lengths, a query_len < 1, a negative computed count, a
                block table too short for its context, or a block id outside [0, num_cache_blocks).
        """
        num_seqs = len(query_lens)
        lengths = {
            "block_tables": len(block_tables),
            "num_computed_tokens": len(num_computed_tokens),
        }
        if any(n != num_seqs for n in lengths.values()):
            raise ValueError(
                "attention metadata needs one block table and computed count per sequence: "
                f"got {lengths} for {num_seqs} sequences (query_lens)"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if sliding_window is not None:
            if sliding_window < 1:
                raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
            block_tables, num_computed_tokens = _crop_to_window(
                block_tables, num_computed_tokens, block_size, sliding_window
            )
        for s in range(num_seqs):
            _check_sequence(s, block_tables[s], num_computed_tokens[s], query_lens[s], block_size)
        seq_lens = [c + q for c, q in zip(num_computed_tokens, query_lens)]
        query_start_loc = [0]
        for q in query_lens:
            query_start_loc.append(query_start_loc[-1] + q)
        tables, slot_mapping = _tables_and_slots(
            block_tables, num_computed_tokens, query_lens, block_size, num_cache_blocks)
        slots_t, tables_t, query_lens_t, seq_lens_t = to_device(
            [slot_mapping, tables, torch.tensor(query_lens, dtype=torch.int64),
             torch.tensor(seq_lens, dtype=torch.int64)], device)
        return cls(
            slot_mapping=slots_t,
            block_tables=tables_t,
            query_start_loc=query_start_loc,
            query_lens=list(query_lens),
            seq_lens=seq_lens,
            block_size=block_size,
            query_lens_t=query_lens_t,
            seq_lens_t=seq_lens_t,
            num_cache_blocks=num_cache_blocks,
            sliding_window=sliding_window,
        )

    def for_tables(self, block_tables: Sequence[Sequence[int | None]],
                   num_computed_tokens: list[int]) -> AttentionMetadata:
        """This step's metadata over another layer group's block tables: the same sequences,
        positions and window (a hybrid layout's groups of one attention type share them, not
        their blocks). num_computed_tokens: the counts `build` was given, before any crop. The
        tables are cropped, checked and mapped to slots as `build` does; the rows' lists and
        length tensors are this metadata's own, not built again.

        Raises:
            ValueError: as `build` does for these tables.
        """
        if len(block_tables) != self.num_seqs or len(num_computed_tokens) != self.num_seqs:
            raise ValueError(
                f"metadata of {self.num_seqs} sequences: got {len(block_tables)} block tables "
                f"and {len(num_computed_tokens)} computed counts"
            )
        if self.sliding_window is not None:
            block_tables, num_computed_tokens = _crop_to_window(
                block_tables, num_computed_tokens, self.block_size, self.sliding_window
            )
        for s in range(self.num_seqs):
            _check_sequence(s, block_tables[s], num_computed_tokens[s], self.query_lens[s],
                            self.block_size)
        if [c + q for c, q in zip(num_computed_tokens, self.query_lens)] != self.seq_lens:
            raise ValueError("for_tables takes the computed counts this metadata was built with")
        tables, slot_mapping = _tables_and_slots(
            block_tables, num_computed_tokens, self.query_lens, self.block_size,
            self.num_cache_blocks)
        slots_t, tables_t = to_device([slot_mapping, tables], self.slot_mapping.device)
        return AttentionMetadata(  # not dataclasses.replace: 4x its cost, every decode step
            slot_mapping=slots_t, block_tables=tables_t, query_start_loc=self.query_start_loc,
            query_lens=self.query_lens, seq_lens=self.seq_lens, block_size=self.block_size,
            query_lens_t=self.query_lens_t, seq_lens_t=self.seq_lens_t,
            num_cache_blocks=self.num_cache_blocks, sliding_window=self.sliding_window,
        )


def _tables_and_slots(
    block_tables: Sequence[Sequence[int | None]],
    num_computed_tokens: list[int],
    query_lens: list[int],
    block_size: int,
    num_cache_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables (each sequence's checked by _check_sequence first), right-padded with 0, as
    [S, max_blocks] int64, and the step's slots [T] int64 (CPU tensors)."""
    num_seqs = len(query_lens)
    max_blocks = max((len(t) for t in block_tables), default=0)
    padded = cast(  # _check_sequence rejected None entries
        "list[list[int]]", [[*t] + [0] * (max_blocks - len(t)) for t in block_tables])
    small = num_seqs * max_blocks <= _SMALL_STEP and sum(query_lens) <= _SMALL_STEP
    if small:  # a decode step: Python's loops cost less than a dozen small tensor ops
        bad = [s for s, t in enumerate(padded) if any(not 0 <= b < num_cache_blocks for b in t)]
    else:
        tables = torch.tensor(padded, dtype=torch.int64).view(num_seqs, max_blocks)  # [S, maxb]
        outside = (tables < 0) | (tables >= num_cache_blocks)  # padding 0 too: harmless
        bad = outside.any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"block table of sequence {bad[0]} holds a block id outside "
            f"[0, {num_cache_blocks}): {block_tables[bad[0]]}"
        )
    if not small:
        return tables, _slot_mapping(tables, num_computed_tokens, query_lens, block_size)
    # Tables and slots from one list: one tensor made where two cost 11 us of a decode step.
    flat = [b for t in padded for b in t]
    both = torch.tensor(flat + _slots(padded, num_computed_tokens, query_lens, block_size),
                        dtype=torch.int64)
    return both[: len(flat)].view(num_seqs, max_blocks), both[len(flat) :]


def _crop_to_window(
    block_tables: Sequence[Sequence[int | None]],
    num_computed_tokens: list[int],
    block_size: int,
    window: int,
) -> tuple[list[Sequence[int | None]], list[int]]:
    tables: list[Sequence[int | None]] = []
    computed = []
    for table, num_computed in zip(block_tables, num_computed_tokens):
        first = first_window_block(num_computed, block_size, window)
        tables.append(table[first:])
        computed.append(num_computed - first * block_size)
    return tables, computed


def _check_sequence(
    s: int, table: Sequence[int | None], num_computed: int, query_len: int, block_size: int
) -> None:
    who = f"sequence {s}"
    if any(block is None for block in table):
        raise ValueError(
            f"block table of {who} lacks a block its window still sees (released): {table}"
        )
    if not isinstance(query_len, int) or query_len < 1:
        raise ValueError(f"query_lens of {who} must be an integer >= 1, got {query_len!r}")
    if not isinstance(num_computed, int) or num_computed < 0:
        raise ValueError(
            f"num_computed_tokens of {who} must be an integer >= 0, got {num_computed!r}"
        )
    seq_len = num_computed + query_len
    if len(table) * block_size < seq_len:
        raise ValueError(
            f"block table of {who} has {len(table)} blocks, too short for a context of "
            f"{seq_len} tokens with block_size {block_size}"
        )


# Steps whose tables hold at most this many entries and that compute at most this many tokens
# build their checks and slots in Python (a decode step of a few sequences: about 10 us against
# 150-300 us for the tensor ops); larger ones use the tensor ops.
_SMALL_STEP = 512


def _slots(
    tables: list[list[int]], num_computed_tokens: list[int], query_lens: list[int], block_size: int
) -> list[int]:
    """_slot_mapping's slots, computed in Python (the same integers)."""
    return [
        table[position // block_size] * block_size + position % block_size
        for table, start, count in zip(tables, num_computed_tokens, query_lens)
        for position in range(start, start + count)
    ]


def _slot_mapping(
    tables: torch.Tensor, num_computed_tokens: list[int], query_lens: list[int], block_size: int
) -> torch.Tensor:
    """[num_tokens] slots of the new tokens: table[pos // block_size] * block_size + pos % bs."""
    if not query_lens:
        return torch.zeros(0, dtype=torch.int64)
    counts = torch.tensor(query_lens, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), counts)  # [T]
    starts = torch.tensor(num_computed_tokens, dtype=torch.int64)
    first_row = torch.cumsum(counts, 0) - counts  # [S] row of each sequence's first token
    positions = starts[seq_of_token] + torch.arange(int(counts.sum())) - first_row[seq_of_token]
    blocks = tables[seq_of_token, positions // block_size]  # [T]
    return blocks * block_size + positions % block_size
