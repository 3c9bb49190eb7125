"""Beam search for one request, step for step the algorithm of HF transformers' `_beam_search`.

Invariant: every running beam and every kept finished hypothesis is a Request whose blocks the KV
manager holds, forked copy-on-write from its parent; nothing a beam computes is published until the
search ends, and then only the returned beams' full blocks (KVCacheManager.finish_beams).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import torch

from kvmemo.kv.hybrid import AnyKVCacheManager
from kvmemo.request import Request, RequestStatus

# A wider beam is almost surely a mistake (HF users rarely go past 16), and each beam is a sequence
# in every step's batch.
MAX_BEAM_WIDTH = 128

# HF's mask for candidates that must not be chosen (fp32 arithmetic, like HF's).


@dataclass(frozen=True)
class BeamSearchParams:
    """How one request's beams are searched, with HF `generate()` meanings.

    length_penalty: a finished beam's score is cumulative logprob / generated_len**length_penalty
        (generated tokens, the final EOS included). early_stopping: True stops once beam_width
        beams have finished; False stops when HF's heuristic says the best running beam (scored
        at its current length) cannot beat the worst finished one; "never" scores it at
        max_tokens when length_penalty > 0, the canonical (slower) stopping rule.
    """

    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(
                f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}"
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        penalty = self.length_penalty
        ok = isinstance(penalty, (int, float)) and not isinstance(penalty, bool)
        if not ok or not math.isfinite(penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        early = self.early_stopping
        if not isinstance(early, (bool, str)) or early not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class FinishedBeam:
    """A finished hypothesis; `request` holds the blocks of its computed tokens until the end."""

    request: Request  # output_token_ids: the generated tokens, the final one (EOS or not) included
    cumulative_logprob: float  # sum of the generated tokens' logprobs
    score: float  # cumulative_logprob / len(output_token_ids) ** length_penalty (fp32, as HF)
    ended_with_eos: bool


class BeamSearch:
    """Owns the beams of one request: the running beams, the finished hypotheses, their blocks.

    beam_width 1 is greedy search, as HF's generate(num_beams=1).

    The root request (the prompt) is prefilled like any request; step() then receives the
    log-softmax rows of every running beam from one batched forward and does HF's update: the
    top (1 + num EOS ids, at least 2) x beam_width continuations over beams x vocabulary; the best
    beam_width of them that do not end become the next beams; those among the best beam_width that
    end (EOS, or max_tokens reached) enter the finished set, which keeps the beam_width best scores.
    """

    def __init__(
        self,
        root: Request,
        params: BeamSearchParams,
        kv: AnyKVCacheManager,
        *,
        eos_token_ids: Collection[int],
        max_new_tokens: int,
    ) -> None:
        self.root = root
        self.params = params
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_new_tokens = max_new_tokens  # params.max_tokens, capped by the model's context
        # HF generate(num_beams=1) is greedy search: one candidate, and the first end stops it.
        width = params.beam_width
        self.num_candidates = 1 if width == 1 else max(2, 1 + len(self.eos_token_ids)) * width
        self._num_forks = 0
        self._reset_state()

    def _reset_state(self) -> None:
        self.beams: list[Request] = []  # running beams, best first; empty while the root prefills
        self.finished: list[FinishedBeam] = []  # best first, at most beam_width
        self.is_done = False
        self._scores = torch.zeros(1)  # [num running] fp32 cumulative logprobs (the root's: 0)
        self._num_generated = 0

    @property
    def running(self) -> list[Request]:
        """The sequences that compute now: the root while its prompt prefills, then the beams."""
        if self.is_done:
            return []
        return self.beams or [self.root]

    @property
    def is_started(self) -> bool:
        """True once the root's prompt is computed and the beams run."""
        return bool(self.beams)

    def step(self, logprobs: torch.Tensor) -> bool:
        """Advances the search by one token per beam; returns True when it has ended.

        Args:
            logprobs: [num running beams (1 for the root), vocab] fp32 log_softmax of the logits
                at each beam's last position, rows in beam order.
        """
        parents = self.beams or [self.root]
        assert logprobs.shape[0] == len(parents), "one logprobs row per running beam"
        assert not self.is_done
        k = self.params.beam_width
        vocab = logprobs.shape[1]
        if self.num_candidates > logprobs.numel():
            raise ValueError(f"beam_width {k} is too large for a vocabulary of {vocab} tokens")
        scores = (logprobs + self._scores.to(logprobs.device)[:, None]).reshape(-1)  # [n * vocab]
        top_scores, top_index = torch.topk(scores, self.num_candidates)  # best first
        top_scores = top_scores.cpu()
        parent_of = (top_index // vocab).tolist()
        token_of = (top_index % vocab).tolist()
        num_generated = self._num_generated + 1
        at_max_length = num_generated >= self.max_new_tokens
        ends = [at_max_length or token in self.eos_token_ids for token in token_of]

        # Only the best k candidates may finish; the rest only back up the running beams.
        finish_scores = (top_scores / (num_generated**self.params.length_penalty)).tolist()
        entrants = [i for i in range(k) if ends[i]]
        self._update_finished(entrants, finish_scores, top_scores, parents, parent_of, token_of)
        keep = [i for i in range(len(ends)) if not ends[i]][:k]  # HF: topk over masked scores
        self._num_generated = num_generated
        self._scores = top_scores[keep]
        if at_max_length or not keep or self._should_stop():
            self._end(parents)
            return True
        self._advance([(parent_of[i], token_of[i]) for i in keep], parents)
        return False

    def _update_finished(
        self,
        entrants: list[int],
        finish_scores: list[float],
        top_scores: torch.Tensor,
        parents: list[Request],
        parent_of: list[int],
        token_of: list[int],
    ) -> None:
        """Merges the newly finished candidates into the k best (HF: topk over old + new)."""
        if not entrants:
            return
        merged: list[tuple[float, int, FinishedBeam | int]] = [
            (f.score, 0, f) for f in self.finished
        ] + [(finish_scores[i], 1, i) for i in entrants]
        merged.sort(key=lambda item: (-item[0], item[1]))  # stable: old beams first on ties
        kept, dropped = merged[: self.params.beam_width], merged[self.params.beam_width :]
        for _, _, entry in dropped:
            if isinstance(entry, FinishedBeam):
                self.kv.free(entry.request)
        finished: list[FinishedBeam] = []
        for score, _, entry in kept:
            if isinstance(entry, int):
                token = token_of[entry]
                request = self._fork(parents[parent_of[entry]], token)
                ended_with_eos = token in self.eos_token_ids
                entry = FinishedBeam(request, float(top_scores[entry]), score, ended_with_eos)
            finished.append(entry)
        self.finished = finished

    def _should_stop(self) -> bool:
        """HF's stopping rules once beam_width hypotheses have finished (see BeamSearchParams)."""
        if len(self.finished) < self.params.beam_width:
            return False
        if self.params.early_stopping is True:
            return True
        penalty = self.params.length_penalty
        if self.params.early_stopping == "never" and penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self._num_generated
        best_running = self._scores[:1] / (best_length**penalty)  # fp32, as HF
        worst_finished = min(f.score for f in self.finished)
        return not float(best_running[0]) > worst_finished

    def _advance(self, chosen: list[tuple[int, int]], parents: list[Request]) -> None:
        """The next beams: (parent index, token) each, forked copy-on-write; unchosen parents are
        freed (they never published a block). The first child of a parent takes it over in place."""
        children: dict[int, list[int]] = {}
        for slot, (p, _) in enumerate(chosen):
            children.setdefault(p, []).append(slot)
        beams: list[Request | None] = [None] * len(chosen)
        for p, parent in enumerate(parents):
            slots = children.get(p, [])
            # The root stays the scheduler's handle on the request, so it is never taken over.
            adopt = bool(slots) and parent is not self.root
            for slot in slots[1:] if adopt else slots:
                beams[slot] = self._fork(parent, chosen[slot][1])
            if adopt:
                parent.append_output_token(chosen[slots[0]][1])
                beams[slots[0]] = parent
            else:
                self.kv.free(parent)  # pruned, or the root after the first step
        self.beams = [beam for beam in beams if beam is not None]

    def _fork(self, parent: Request, token: int) -> Request:
        """A new beam: the parent's tokens plus `token`, sharing the parent's blocks."""
        self._num_forks += 1
        assert parent.num_computed_tokens == parent.num_tokens
        child = Request(
            request_id=f"{self.root.request_id}#beam{self._num_forks}",
            prompt_token_ids=self.root.prompt_token_ids,
            sampling_params=self.root.sampling_params,
            arrival_time=self.root.arrival_time,
            mm_items=self.root.mm_items,
            mm_data=self.root.mm_data,
            cache_salt=self.root.cache_salt,
            eos_token_ids=self.root.eos_token_ids,
            output_token_ids=[*parent.output_token_ids, token],
            all_token_ids=[*parent.all_token_ids, token],
            block_hashes=list(parent.block_hashes),
            num_computed_tokens=parent.num_tokens,
            status=RequestStatus.RUNNING,
            hasher=self.root.hasher,
            sample_tokens=False,
        )
        self.kv.fork(parent, child)
        return child

    def _end(self, parents: list[Request]) -> None:
        """Publishes the finished beams' full blocks and frees every block of the search."""
        pruned = [p for p in parents if p is not self.root]
        if not self.beams:
            pruned.append(self.root)  # ended at the first step: the root still holds the prompt
        self.kv.finish_beams([f.request for f in self.finished], pruned)
        self.beams = []
        self.is_done = True

    def free(self) -> None:
        """Frees every block of the search (abort or preemption); publishes nothing."""
        for request in [*self.beams, *(f.request for f in self.finished), self.root]:
            self.kv.free(request)

    def reset(self) -> None:
        """Preemption: free everything and start over from the prompt (the search is deterministic,
        so the result is the same; the prompt's committed blocks make the restart cheap)."""
        self.free()
        self._reset_state()
