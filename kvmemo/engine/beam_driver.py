"""BeamSearchDriver: runs beam searches above the scheduler, between engine steps.

Invariant: every beam is an ordinary running Request that does not sample (sample_tokens False):
the scheduler computes its next token's KV like any decode and the runner returns its log-softmax
row. Once every running sequence of a search has its row, the search steps (BeamSearch, HF's
algorithm): forks join the scheduler's running list already holding their blocks (copy-on-write,
KVCacheManager.fork), pruned beams leave it. A search any of whose beams was preempted starts
over from its prompt, whose blocks are cached, so the result is the same.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from kvmemo.engine.beam_search import BeamSearch, BeamSearchParams
from kvmemo.engine.scheduler import Scheduler
from kvmemo.errors import InputError
from kvmemo.kv.hybrid import AnyKVCacheManager
from kvmemo.request import Request, RequestStatus


class BeamSearchDriver:
    """Owns the running beam searches by request id, and the rows of beams waiting for siblings."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv: AnyKVCacheManager,
        *,
        eos_token_ids: Collection[int],
        vocab_size: int,
        max_model_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.searches: dict[str, BeamSearch] = {}
        # Rows of sequences computed in an earlier step than a sibling (the token budget split
        # the search's beams over two steps): kept until every beam has one.
        self._rows: dict[str, torch.Tensor] = {}

    def add(self, root: Request, params: BeamSearchParams) -> BeamSearch:
        """Validates and queues one search whose prompt is `root` (built with sample_tokens
        False). Raises InputError when it could never fit the vocabulary or the cache."""
        search = BeamSearch(
            root,
            params,
            self.kv,
            eos_token_ids=self.eos_token_ids,
            max_new_tokens=min(params.max_tokens, self.max_model_len - root.num_prompt_tokens),
        )
        if search.num_candidates > self.vocab_size:
            raise InputError(
                "beam_width",
                f"beam_width {params.beam_width} is too large for a vocabulary of "
                f"{self.vocab_size} tokens",
            )
        # Worst case: the prompt's blocks shared, then a private chain per running beam and per
        # kept finished beam (plus a copied partial block each).
        size = self.kv.block_size
        width = params.beam_width
        blocks_needed = len(self.kv.layout.groups) * (  # every layer group holds its own
            -(-root.num_prompt_tokens // size) + 2 * width * (-(-search.max_new_tokens // size) + 1)
        )
        if blocks_needed > self.kv.num_blocks:
            raise InputError(
                "beam_width",
                f"beam search with beam_width {width} may need {blocks_needed} KV blocks but "
                f"the KV cache holds only {self.kv.num_blocks}; lower beam_width or max_tokens",
            )
        self.scheduler.add_request(root)  # its own checks: a free id, the prompt's length
        self.searches[root.request_id] = search
        return search

    def abort(self, request_id: str) -> bool:
        """Ends the search of `request_id` and frees all its blocks; False if it runs none."""
        search = self.searches.pop(request_id, None)
        if search is None:
            return False
        self._drop(search.running)
        search.free()
        return True

    def after_step(
        self, rows: dict[str, torch.Tensor], preempted_request_ids: Collection[str]
    ) -> list[BeamSearch]:
        """Feeds the step's log-softmax rows to their searches; returns the searches that ended
        (removed from the driver, every block free, winners' blocks published)."""
        self._rows.update(rows)
        ended: list[BeamSearch] = []
        preempted = set(preempted_request_ids)
        for request_id, search in list(self.searches.items()):
            running = search.running
            if search.is_started and any(r.request_id in preempted for r in running):
                self._restart(search)
                continue
            if not all(r.request_id in self._rows for r in running):
                continue  # the prompt is still prefilling, or a beam computes next step
            logprobs = torch.stack([self._rows.pop(r.request_id) for r in running])
            if not search.is_started:  # the prompt's blocks are published as any prompt's
                self.kv.commit(search.root, search.root.num_computed_tokens)
            done = search.step(logprobs)
            after = {r.request_id for r in search.running}
            self._drop([r for r in running if r.request_id not in after])
            kept = {r.request_id for r in running}
            for beam in search.beams:
                if beam.request_id not in kept:
                    self.scheduler.add_running(beam)
            if done:
                best = search.finished[0] if search.finished else None
                stopped = best is not None and best.ended_with_eos
                search.root.status = (
                    RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_LENGTH
                )
                del self.searches[request_id]
                ended.append(search)
        return ended

    def _drop(self, sequences: list[Request]) -> None:
        """Takes sequences out of the scheduler (their blocks are freed, if still held)."""
        for request in sequences:
            self._rows.pop(request.request_id, None)
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)

    def _restart(self, search: BeamSearch) -> None:
        """A beam lost its KV: free the whole search and queue its prompt again (deterministic,
        so the beams come out the same)."""
        self._drop(search.running)
        search.reset()
        root = search.root
        root.num_computed_tokens = 0
        root.num_preemptions += 1
        self.scheduler.requeue(root)
