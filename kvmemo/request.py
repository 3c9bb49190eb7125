"""Request: one sequence's life in the engine (no torch).

Invariant: all_token_ids == prompt_token_ids + output_token_ids, and block_hashes holds the hash
of every full block of all_token_ids: a request built with a hasher extends them itself, at
construction and whenever a token is appended (the one place they grow).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmemo.kv.miss_ledger import MissReport
from kvmemo.kv.mm_items import MultiModalItem, overlapping_items
from kvmemo.kv.retention import Retention
from kvmemo.sampling import SamplingParams

if TYPE_CHECKING:
    from kvmemo.kv.hashing import BlockHash, RequestHasher


@dataclass(slots=True, eq=False)
class BlendSpec:
    """How a segmented prompt reuses chunk KV (see kvmemo/engine/blend_driver.py).

    Segment 0 is the context every chunk is computed after; the last is the question, always
    recomputed; each segment between is a chunk whose KV comes from chunk_requests.
    """

    context_len: int  # tokens of segment 0: where chunk KV was computed from
    chunk_ranges: list[tuple[int, int]]  # [start, end) of each chunk segment in the prompt
    chunk_requests: list[Request]  # the chunk sequence of each range (context + chunk tokens)
    recompute_ratio: float  # share of the reused tokens recomputed (the most deviating)
    check_layer: int  # layer whose K/V deviation picks them
    # Filled by the step that blends: tokens whose KV was reused as is (the rest of the uncached
    # prompt was computed).
    num_reused_tokens: int = 0


class RequestStatus(enum.IntEnum):
    """Finished states compare greater than PREEMPTED, so `status > PREEMPTED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(slots=True, eq=False)
class Request:
    """Owns a sequence's tokens, block hashes and progress; the KV blocks live in the manager."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    mm_items: list[MultiModalItem] = field(default_factory=list)
    # What the encoder needs for each item (processed pixel arrays), parallel to mm_items;
    # opaque here, so this module and kv/ stay free of torch.
    mm_data: list[Any] = field(default_factory=list)
    cache_salt: str | None = None
    # Prompt prefixes to keep cached for a while after the request ends (kv/retention.py)
    retention: tuple[Retention, ...] = ()
    # vLLM's priority (lower is more important, 0 by default); above 0, the blocks only this
    # request used are evicted before any other free block when it ends (kv/block_pool.py)
    priority: int = 0
    # Why its uncached prompt tokens were computed (kv/miss_causes.py), at first schedule
    miss_report: MissReport | None = None
    token_keys: list[bytes] = field(default_factory=list)  # its blocks' keys over tokens alone
    prompt_text: str | None = None  # the prompt as text, when it was given as text
    eos_token_ids: frozenset[int] = frozenset()

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Tokens whose KV is in the request's blocks (or will be, once the scheduled step runs).
    num_computed_tokens: int = 0
    # Prompt tokens served from a cache at first schedule; None until then.
    num_cached_tokens: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # The engine's block hasher; None only for requests that never meet a cache (some tests).
    hasher: RequestHasher | None = None
    # False: the sequence is driven from above the scheduler (a beam of a beam search). A step
    # that reaches its end returns the log-softmax row of its last position instead of sampling,
    # and its driver, not the scheduler, appends its tokens and publishes its blocks.
    sample_tokens: bool = True
    # The structured-output Constraint its tokens must follow (kvmemo.structured.grammar), or
    # None; opaque here. The engine advances it past every token the request takes.
    constraint: Any = None
    # (token index, name): the block holding that token, and so every block after it in the
    # chain, is hashed with ("reuse", name) among its extra keys. A chunk's KV ("chunk") and a
    # blended prompt's ("blend/...") thereby never serve an exact-prefix lookup, while the
    # blocks before stay shared with exact requests.
    kv_marker: tuple[int, str] | None = None
    # A blended prompt's plan (BlendSpec), set by the engine's blend driver; None otherwise.
    blend: BlendSpec | None = None
    # Speculative decoding: the tokens drafted for the next step (kvmemo/spec), verified there;
    # never part of all_token_ids or block_hashes until kept.
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafts: int = 0  # steps that verified a draft
    num_draft_tokens: int = 0  # drafted tokens verified so far
    num_rejected_drafts: int = 0  # steps whose draft was cut short
    num_accepted_tokens: int = 0  # of those, kept

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self.extend_block_hashes()

    def extend_block_hashes(self) -> None:
        """Hashes every newly full block (a no-op until a block fills, or without a hasher)."""
        if self.hasher is not None:
            self.hasher.extend(self)

    @property
    def skips_prefix_cache(self) -> bool:
        """Reads no cached KV (it still shares what it computes): prompt logprobs need every
        prompt position's logits, which only a forward over it gives."""
        return self.sampling_params.prompt_logprobs is not None

    def mm_inputs(self, start: int, end: int) -> tuple:
        """(item, encoder input) of each image whose placeholders meet [start, end): only those
        need features in a step over those tokens, so an image whose blocks were all cache hits
        is never encoded."""
        if not self.mm_items or start >= self.num_prompt_tokens:
            return ()
        items = self.mm_items
        return tuple((items[i], self.mm_data[i]) for i in overlapping_items(items, start, end))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.extend_block_hashes()

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens past the first num_output_tokens (a stop string ended the
        output inside a verified draft: what followed it is not produced)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - drop :]
        if self.hasher is not None:
            del self.block_hashes[self.num_tokens // self.hasher.block_size :]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
