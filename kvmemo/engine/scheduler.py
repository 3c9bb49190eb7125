"""Scheduler: continuous batching under a per-step token budget, with chunked prefill.

Invariant: running requests are scheduled before waiting ones; a request is admitted only when
its blocks can be allocated; when blocks run out, the newest running request is preempted
(its KV freed, recomputed later), so the oldest always progresses and nothing deadlocks.
Every sequence is a Request; sequences driven from above (beam search) differ only in
Request.sample_tokens, and the scheduler knows nothing of what drives them.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmemo.engine.blend_chunks import blend_step, hold_chunks, release_chunks
from kvmemo.engine.scheduler_output import (
    BlendStep,
    ScheduledSequence,
    SchedulerOutput,
)
from kvmemo.errors import InputError
from kvmemo.kv.hashing import BlockHash
from kvmemo.kv.hybrid import AnyKVCacheManager
from kvmemo.kv.miss_causes import explain_misses
from kvmemo.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvmemo.connector.base import KVConnector

logger = logging.getLogger(__name__)

# Past this many waiting requests, scoring each one's cached prefix costs more than it saves:
# fall back to arrival order (SGLang does the same).
_MAX_WAITING_FOR_PREFIX_ORDER = 128


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


class Scheduler:
    """Owns the waiting queue and the running list; the KV manager owns the blocks."""

    def __init__(
        self,
        limits: SchedulerLimits,
        kv_manager: AnyKVCacheManager,
        connector: KVConnector | None = None,
    ):
        self.limits = limits
        self.kv = kv_manager
        self.connector = connector  # external KV store: hits beyond the device prefix cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Chunk sequences whose cached blocks a blended prompt reads this step: held (so no
        # allocation evicts them) from its admission until the step's results come back.
        self._held_chunks: list[Request] = []

    # ---- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if it could never fit the model or the cache."""
        self.check_fits(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Raises InputError unless `request` could ever run: a free id, a prompt shorter than the
        context, and blocks for its prompt plus max_tokens."""
        if request.request_id in self.requests:
            raise InputError(None, f"request_id {request.request_id!r} is already in use")
        max_len = self.limits.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise InputError(
                "prompt",
                f"prompt is {request.num_prompt_tokens} tokens; the model's context is {max_len} "
                f"tokens, so the prompt must be at most {max_len - 1} tokens",
            )
        max_total = min(request.num_prompt_tokens + request.sampling_params.max_tokens, max_len)
        blocks_needed = self.kv.blocks_needed(max_total, self.limits.max_num_batched_tokens)
        if blocks_needed > self.kv.num_blocks:
            raise InputError(
                "max_tokens",
                f"request needs up to {max_total} tokens ({blocks_needed} KV blocks) but the KV "
                f"cache holds only {self.kv.num_blocks} blocks of {self.kv.block_size} tokens; "
                "lower max_tokens or raise kv_cache_memory / num_blocks",
            )

    def add_running(self, request: Request) -> None:
        """A sequence whose KV is already in blocks it holds (a fork: KVCacheManager.fork) joins
        the running list directly, as the newest."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def requeue(self, request: Request) -> None:
        """A request that lost its KV outside a schedule (its driver restarted it) goes back to
        the front of the waiting queue, as a preempted one does."""
        self.check_fits(request)
        request.status = RequestStatus.PREEMPTED
        self.requests[request.request_id] = request
        self.waiting.appendleft(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        blends: dict[str, BlendStep] = {}

        # Running requests first: decodes (with their drafts) and unfinished prefill chunks.
        drafts: dict[str, list[int]] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:  # waits for its driver to give it a token (a beam between steps)
                i += 1
                continue
            # A decode verifies its draft in the same step, within its share of the budget.
            share = min(budget, self.limits.max_num_batched_tokens // len(self.running))
            draft = request.draft_token_ids[: share - 1] if num_new == 1 else []
            while self.kv.allocate_slots(request, num_new + len(draft)) is None:
                if draft:  # the draft is a guess: it gives way before any request does
                    draft = []
                    continue
                victim = self.running.pop()  # the newest; never one already scheduled (index < i)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                drafts[request.request_id] = draft
                scheduled.append((request, num_new))
                budget -= num_new + len(draft)
                i += 1

        # Then waiting requests, while budget, sequence slots and blocks last. No admission in a
        # step that had to preempt: the pool is under pressure. (A step of decodes alone, the
        # common case, skips the in-flight bookkeeping below.)
        if not preempted and self.waiting:
            self._order_waiting(budget)
            in_flight = self._blocks_being_computed()
            computing: dict[BlockHash, Request] = {}
            for request, num_new in scheduled:
                self._track_computing(computing, request, num_new)
            deferred: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
                request = self.waiting.popleft()
                prefix = self.kv.get_computed_blocks(request)
                if self._next_block_in_flight(
                    request, prefix.num_tokens, in_flight
                ) and self._can_share_in_flight(request):
                    # Blocks this very step computes for another request: share them (their KV
                    # is written before any attention of the step reads it).
                    prefix = self.kv.extend_in_flight(request, prefix, computing)
                # Check before the store read: a block this step computes or loads for another
                # request, and that could not be shared, is a device hit next step, so computing
                # it again or reading it from the store (a second copy) would be waste.
                if self._next_block_in_flight(request, prefix.num_tokens, in_flight):
                    deferred.append(request)
                    continue
                num_external = 0
                if self.connector is not None and not request.skips_prefix_cache:
                    num_full = len(prefix.blocks) * self.kv.block_size
                    num_external = self.connector.get_num_new_matched_tokens(request, num_full)
                    if num_external > 0 and prefix.partial is not None:
                        # The store has the whole block the partial match covers part of.
                        whole = self.kv.drop_partial(request, prefix)
                        if whole is None:  # a window group cannot serve the shorter hit
                            num_external = 0
                        else:
                            prefix = whole
                num_cached = prefix.num_tokens + num_external
                if self._next_block_in_flight(request, num_cached, in_flight):
                    deferred.append(request)
                    continue
                num_new = min(request.num_tokens - num_cached, budget)
                held: list[Request] = []
                if request.blend is not None:
                    # A blend computes the whole prompt in one step (its selection needs every
                    # token); its chunks' blocks are held first, so its own allocation cannot
                    # evict them.
                    num_new = request.num_tokens - num_cached
                    held = hold_chunks(self.kv, request)
                new_block_ids = self.kv.allocate_slots(request, num_external + num_new, prefix)
                if new_block_ids is None:
                    release_chunks(self.kv, held)
                    self.waiting.appendleft(request)
                    break
                if request.blend is not None:
                    self._held_chunks.extend(held)
                    blends[request.request_id] = blend_step(self.kv, request, num_cached)
                if self.connector is not None:
                    # The first num_external // block_size new blocks receive the store's KV
                    # (in every layer group of a hybrid layout).
                    targets = self.kv.load_targets(
                        request, prefix.num_tokens // self.kv.block_size,
                        num_external // self.kv.block_size,
                    )
                    self.connector.update_state_after_alloc(request, targets, num_external)
                request.num_computed_tokens = num_cached
                if request.num_cached_tokens is None:
                    request.num_cached_tokens = num_cached
                    request.miss_report = explain_misses(self.kv, request, num_cached)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled.append((request, num_new))
                budget -= num_new
                self._track_computing(computing, request, num_new)
                # Blocks loaded from the store this step count as in flight too: they commit
                # after the step, like the ones computed. Without prefix caching nothing
                # commits, so nothing is worth waiting for or sharing.
                if self.kv.enable_caching:
                    in_flight.update(
                        request.block_hashes[prefix.num_tokens // self.kv.block_size :]
                    )
            self.waiting.extendleft(reversed(deferred))

        sequences = [
            ScheduledSequence(
                request_id=r.request_id,
                token_ids=[
                    *r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + n],
                    *drafts.get(r.request_id, ()),
                ],
                num_computed_tokens=r.num_computed_tokens,
                block_table=self.kv.get_block_table(r.request_id),
                group_block_tables=(
                    self.kv.get_group_block_tables(r.request_id) if self.kv.layout.is_hybrid else []
                ),
                needs_sample=r.num_computed_tokens + n == r.num_tokens,
                sampling_params=r.sampling_params,
                num_output_tokens=r.num_output_tokens,
                mm_inputs=r.mm_inputs(r.num_computed_tokens, r.num_computed_tokens + n),
                return_logprobs_row=not r.sample_tokens,
                token_history=(
                    (r.prompt_token_ids, r.output_token_ids)
                    if r.sampling_params.has_penalties
                    else None
                ),
                constraint=r.constraint,
                prompt_token_ids=(
                    r.prompt_token_ids
                    if r.skips_prefix_cache and r.num_computed_tokens < r.num_prompt_tokens - 1
                    else None
                ),
                blend=blends.get(r.request_id),
                draft_token_ids=tuple(drafts.get(r.request_id, ())),
            )
            for r, n in scheduled
        ]
        copies = [(c.src_block_id, c.dst_block_id, c.num_tokens) for c in self.kv.take_copies()]
        connector_metadata = (
            self.connector.build_connector_meta() if self.connector is not None else None
        )
        return SchedulerOutput(
            sequences=sequences,
            block_copies=copies,
            preempted_request_ids=preempted,
            kv_connector_metadata=connector_metadata,
        )

    def _blocks_being_computed(self) -> set[BlockHash]:
        """Hashes of full blocks that running prefills have not finished computing yet."""
        if not self.kv.enable_caching:
            return set()
        size = self.kv.block_size
        return {
            h
            for r in self.running
            if r.num_computed_tokens < r.num_tokens - 1
            for h in r.block_hashes[r.num_computed_tokens // size :]
        }

    def _can_share_in_flight(self, request: Request) -> bool:
        """Whether `request` may share blocks computed in its own step (extend_in_flight): not
        without prefix caching, in a hybrid layout, or for a blend or a prompt that skips the
        cache."""
        return (
            self.kv.enable_caching
            and not self.kv.layout.is_hybrid
            and request.blend is None
            and not request.skips_prefix_cache
        )

    def _track_computing(
        self, computing: dict[BlockHash, Request], request: Request, num_new: int
    ) -> None:
        """Records the full blocks `request` completes in the step being scheduled (from its
        num_computed_tokens on; a draft's never count), for requests admitted after it to share.
        Not recorded: a beam (it publishes its blocks when its search ends); a blend (computed
        after the step's other sequences, so a sharer would read its blocks before they are
        written); a single new token (a sharing step computes prompt chunks, so never takes the
        fused decode path, which writes each sequence's slot as it attends)."""
        if (
            not request.sample_tokens
            or request.blend is not None
            or num_new < 2
            or not self.kv.enable_caching
        ):
            return
        size = self.kv.block_size
        start = request.num_computed_tokens
        end = min((start + num_new) // size, len(request.block_hashes))
        for block_hash in request.block_hashes[start // size : end]:
            computing.setdefault(block_hash, request)

    def _next_block_in_flight(
        self, request: Request, num_cached_tokens: int, in_flight: set[BlockHash]
    ) -> bool:
        """True when another request is computing this request's next block right now.

        Computing it twice in one step would waste the work the prefix cache exists to save;
        waiting one step turns it into a hit (blocks commit after the step that computes them).
        """
        index = num_cached_tokens // self.kv.block_size
        return index < len(request.block_hashes) and request.block_hashes[index] in in_flight

    def _order_waiting(self, budget: int) -> None:
        """When the budget cannot take every waiting prompt, serve cached prefixes first.

        Longest cached prefix first, so hits are used before eviction takes them; preempted
        requests keep their place at the front. Among equal hits, requests whose next block to
        compute is the same (a shared prompt nobody has computed yet) follow the first of them
        to arrive: it computes those blocks and the rest share them in the same step
        (extend_in_flight) for the cost of their own tokens, before another long prompt takes the
        budget. Otherwise arrival order holds (the sort is stable).
        """
        if len(self.waiting) < 2 or len(self.waiting) > _MAX_WAITING_FOR_PREFIX_ORDER:
            return
        if sum(r.num_tokens for r in self.waiting) <= budget:
            return
        keys: dict[str, tuple[bool, int, int]] = {}
        group_rank: dict[BlockHash, int] = {}
        for position, request in enumerate(self.waiting):
            prefix = self.kv.get_computed_blocks(request)
            index = len(prefix.blocks)
            rank = position
            if index < len(request.block_hashes) and self._can_share_in_flight(request):
                rank = group_rank.setdefault(request.block_hashes[index], position)
            preempted = request.status == RequestStatus.PREEMPTED
            keys[request.request_id] = (not preempted, -prefix.num_tokens, rank)
        self.waiting = deque(sorted(self.waiting, key=lambda r: keys[r.request_id]))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (recompute)", request.request_id)

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[Request]:
        """Advance scheduled requests by the step's results.

        Appends sampled tokens (one, or a verified draft's kept tokens and the one after them),
        applies token-level stop rules after each, commits the blocks whose KV the step computed
        for tokens kept (so they are reusable from the next step on, while the request still
        runs; a rejected draft token's slot is never committed, and its block hash never made)
        and frees finished requests. A sequence that does not sample (Request.sample_tokens) is
        only advanced: its driver appends its tokens and decides what it publishes. Returns the
        requests that got a new token or finished.
        """
        release_chunks(self.kv, self._held_chunks)
        self._held_chunks = []
        touched: list[Request] = []
        for seq in output.sequences:
            request = self.requests[seq.request_id]
            num_drafted = len(seq.draft_token_ids)
            request.num_computed_tokens += len(seq.token_ids) - num_drafted
            if not request.sample_tokens:
                continue
            if seq.needs_sample:
                tokens = sampled_token_ids[seq.request_id]
                if num_drafted:
                    request.num_drafts += 1
                    request.num_draft_tokens += num_drafted
                    request.num_accepted_tokens += len(tokens) - 1
                    request.num_rejected_drafts += len(tokens) - 1 < num_drafted
                for n, token in enumerate(tokens):
                    if n:  # the KV of the kept draft token before it was computed this step
                        request.num_computed_tokens += 1
                    request.append_output_token(token)
                    self._check_token_stop(request)
                    if request.is_finished:
                        break
                touched.append(request)
            self.kv.commit(request, request.num_computed_tokens)
            if request.is_finished:
                self._release(request)
        return touched

    def _check_token_stop(self, request: Request) -> None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if not params.ignore_eos and token in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
        elif token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
        elif (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.limits.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish a request from outside (stop string, abort). Frees its blocks; idempotent."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status is RequestStatus.WAITING or request.status is RequestStatus.PREEMPTED:
            self.waiting.remove(request)
            self.kv.free(request)
        request.status = status
        self._release(request)

    def _release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
            self.kv.retain(request)  # its Retention ranges, if any, before its blocks go free
            self.kv.free(request)
        self.requests.pop(request.request_id, None)
