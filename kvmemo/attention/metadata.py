"""AttentionMetadata: where each token of one flattened step batch lives in the paged cache.

Invariant: built once per step; sequence s owns query rows
query_start_loc[s]:query_start_loc[s+1] and attends to its first seq_lens[s] cached tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs, validated at construction (see `build`)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, right-padded with 0
    query_start_loc: list[int]  # [num_seqs + 1] prefix sums of query_lens
    query_lens: list[int]  # new tokens per sequence this step
    seq_lens: list[int]  # context length per sequence after this step (cached + new)
    block_size: int
    request_ids: list[str]  # one per sequence, carried for logging / beam addressing
    beam_indices: list[int]  # one per sequence: its beam within its request (0 without beams)
    query_lens_t: torch.Tensor  # [num_seqs] int64 (device copy of query_lens)
    seq_lens_t: torch.Tensor  # [num_seqs] int64 (device copy of seq_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def is_all_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @classmethod
    def build(
        cls,
        *,
        block_tables: list[list[int]],
        num_computed_tokens: list[int],
        query_lens: list[int],
        block_size: int,
        num_cache_blocks: int,
        request_ids: list[str],
        beam_indices: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Validate the per-sequence lists and derive slot mapping and padded tensors.

        Raises:
            ValueError: lists of different lengths, a block table too short for its context,
                or a block id outside the cache.
        """
        num_seqs = len(query_lens)
        if not (len(block_tables) == len(num_computed_tokens) == len(request_ids) == num_seqs):
            raise ValueError(
                "attention metadata needs one block table, computed count and request id per "
                f"sequence: got {len(block_tables)} block tables, {len(num_computed_tokens)} "
                f"counts and {len(request_ids)} request ids for {num_seqs} sequences"
            )
        if beam_indices is None:
            beam_indices = [0] * num_seqs
        if len(beam_indices) != num_seqs:
            raise ValueError(
                f"beam_indices must hold one entry per sequence: got {len(beam_indices)} for "
                f"{num_seqs} sequences"
            )
        seq_lens = [c + q for c, q in zip(num_computed_tokens, query_lens)]
        slots: list[int] = []
        for s, (table, start, seq_len) in enumerate(zip(block_tables, num_computed_tokens, seq_lens)):
            if len(table) * block_size < seq_len:
                raise ValueError(
                    f"block table of sequence {s} ({request_ids[s]}) has {len(table)} blocks, "
                    f"too short for a context of {seq_len} tokens with block_size {block_size}"
                )
            for pos in range(start, seq_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        if any(b < 0 or b >= num_cache_blocks for table in block_tables for b in table):
            raise ValueError(f"a block table holds a block id outside [0, {num_cache_blocks})")
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        query_start_loc = [0]
        for q in query_lens:
            query_start_loc.append(query_start_loc[-1] + q)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device).view(num_seqs, max_blocks),
            query_start_loc=query_start_loc,
            query_lens=list(query_lens),
            seq_lens=seq_lens,
            block_size=block_size,
            request_ids=list(request_ids),
            beam_indices=list(beam_indices),
            query_lens_t=torch.tensor(query_lens, dtype=torch.int64, device=device),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        )
