"""SchedulerOutput: the contract between the scheduler and the model runner for one step.

Invariant: every scheduled sequence's block table covers num_computed_tokens + len(token_ids)
tokens, and block_copies run (in order), then the connector's loads, before the step's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmemo.sampling import SamplingParams

if TYPE_CHECKING:
    from kvmemo.connector.base import ConnectorMetadata
    from kvmemo.kv.mm_items import MultiModalItem
    from kvmemo.structured.grammar import Constraint, FixedMask


@dataclass(frozen=True, slots=True)
class ChunkSource:
    """Cached chunk KV a blended prompt reuses: num_tokens tokens that sit at positions
    src_start.. of a chunk sequence (its block table) and go to positions dst_start.. of the
    prompt, keys moved to their new positions (attention/blend.py)."""

    dst_start: int
    src_start: int
    num_tokens: int
    src_block_table: list[int | None]


@dataclass(frozen=True, slots=True)
class BlendStep:
    """A blended prefill (kvmemo/engine/blend_forward.py): the sequence's whole uncached prompt
    in one step, with its chunk segments' KV copied from `sources` and only the tokens picked
    on the check layer, plus every token no source covers, recomputed past it."""

    sources: tuple[ChunkSource, ...]
    recompute_ratio: float
    check_layer: int


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One sequence's share of the step."""

    request_id: str
    token_ids: list[int]  # tokens whose KV this step computes (a prefill chunk, or 1 to decode)
    num_computed_tokens: int  # tokens already in the cache; position of token_ids[0]
    block_table: list[int | None]  # the request's block ids, in order (its group 0's)
    needs_sample: bool  # the chunk reaches the sequence's end, so its last position samples
    sampling_params: SamplingParams
    num_output_tokens: int  # tokens generated so far (the sampler's per-request step index)
    # Images whose placeholder range meets this chunk, with their encoder inputs (pixel arrays):
    # the runner writes the features of the covered positions into the chunk's embeddings.
    mm_inputs: tuple[tuple[MultiModalItem, Any], ...] = ()
    # The runner returns the fp32 log-softmax row of the last position instead of sampling a
    # token (a sequence driven from above the scheduler, e.g. a beam; see Request.sample_tokens).
    return_logprobs_row: bool = False
    # (prompt ids, output ids so far), references to the request's lists, for a request whose
    # sampling has penalties (the sampler counts them); None otherwise.
    token_history: tuple[Sequence[int], Sequence[int]] | None = None
    # The request's structured-output Constraint (its next token's mask), or None; a draft
    # row's view holds the mask at its point of the draft (kvmemo/engine/draft_verify.py).
    constraint: Constraint | FixedMask | None = None
    # The prompt, for a request that wants prompt logprobs and whose chunk holds prompt
    # positions that predict a prompt token (all but the last); None otherwise.
    prompt_token_ids: Sequence[int] | None = None
    # A hybrid layout's block table per layer group (layout.groups order); None entries are
    # blocks a sliding window released. Empty for a single-group layout: block_table is all.
    group_block_tables: list[list[int | None]] = field(default_factory=list)
    # Set on the step that computes a blended prompt (Request.blend); None otherwise.
    blend: BlendStep | None = None
    # Speculative decoding: the drafted tokens that end token_ids (after the request's last
    # token); every one of those rows samples, and verification keeps the agreeing prefix.
    draft_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """What the runner must do this step."""

    sequences: list[ScheduledSequence]
    block_copies: list[tuple[int, int, int]]  # (src_block_id, dst_block_id, num_tokens), in order
    preempted_request_ids: list[str]  # preempted this step (their KV will be recomputed)
    # Blocks to load from the KV store, copied into their pages after block_copies, before the
    # forward (None without a store).
    kv_connector_metadata: ConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return not self.sequences
