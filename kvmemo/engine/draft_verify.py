"""Verification: a drafted sequence's rows sampled as plain decode steps, and what is kept.

Row j of a sequence with draft d (j = 0..len(d)) is the position after the request's last token
and d[:j]: it is sampled exactly as a plain step would sample it had d[:j] been the output so
far (its step index for the seed, its penalty history, its grammar mask). The draft is kept up
to the first row whose token differs from it, and that row's token follows (or, with every
draft token kept, the last row's). For a deterministic draft this is the standard rejection
rule: d[j] is kept with probability p_j(d[j]), and a rejected row's token is distributed as
p_j without d[j], renormalised; so outputs keep the target distribution, and with the same
uniforms they are the plain run's tokens exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

from kvmemo.engine.scheduler_output import ScheduledSequence
from kvmemo.structured.grammar import Constraint

T = TypeVar("T")


def draft_rows(seq: ScheduledSequence, vocab_size: int) -> list[ScheduledSequence]:
    """One sampling view of `seq` per row it verifies (len(draft) + 1 of them)."""
    draft = seq.draft_token_ids
    if not draft:
        return [seq]
    constraint = seq.constraint
    masks = None
    if constraint is not None:
        assert isinstance(constraint, Constraint), "a draft's views are made once"
        masks = constraint.masks_along(draft, vocab_size)
    rows = []
    for j in range(len(draft) + 1):
        history = seq.token_history
        if history is not None:
            prompt_ids, output_ids = history
            history = (prompt_ids, [*output_ids, *draft[:j]])
        rows.append(dataclasses.replace(
            seq,
            num_output_tokens=seq.num_output_tokens + j,
            token_history=history,
            constraint=masks[j] if masks is not None else None,
        ))
    return rows


def accepted(draft: Sequence[int], row_tokens: Sequence[T], token_id_of=lambda t: t) -> list[T]:
    """The rows' tokens a drafted step keeps: the draft's agreed prefix and the next one."""
    kept = 0
    while kept < len(draft) and token_id_of(row_tokens[kept]) == draft[kept]:
        kept += 1
    return list(row_tokens[: kept + 1])
