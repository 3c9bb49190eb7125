"""DraftProposer: the draft each running request takes into its next step, from the source its
SpeculativeConfig names, cut so that verifying it can never run past what the request may
produce (max_tokens, the context, a stop token, its grammar)."""

from __future__ import annotations

from collections.abc import Sequence

from kvmemo.request import Request
from kvmemo.spec.config import SpeculativeConfig
from kvmemo.spec.ngram import ngram_draft
from kvmemo.spec.policy import CPU_NATIVE_COST, acceptance, best_length
from kvmemo.spec.suffix import SuffixIndex


class DraftProposer:
    """Owns the suffix index (method "suffix") and the per-step draft of each request."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 cost: Sequence[float] = CPU_NATIVE_COST):
        self.config = config
        self.max_model_len = max_model_len
        self.cost = tuple(cost)  # a step verifying k drafts, in plain steps (policy.py)
        self.suffix = (
            SuffixIndex(
                max_depth=config.suffix_decoding_max_tree_depth,
                max_spec_factor=config.suffix_decoding_max_spec_factor,
                min_token_prob=config.suffix_decoding_min_token_prob,
                max_sequences=config.suffix_decoding_max_cached_requests,
                max_tokens=config.suffix_index_max_tokens,
            )
            if config.method == "suffix" else None
        )

    def propose(self, request: Request) -> list[int]:
        """The draft for `request`'s next step ([] for a sequence speculation ignores: a beam,
        a blend's chunks or blended prompt)."""
        if not request.sample_tokens or request.blend is not None or request.kv_marker:
            return []
        params = request.sampling_params
        room = min(
            self.config.num_draft_tokens,
            params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if room <= 0:
            return []
        confidence = 0.0
        if self.suffix is not None:
            draft, confidence = self.suffix.draft_with_confidence(
                request.all_token_ids, request.cache_salt, room
            )
        else:
            draft = ngram_draft(
                request.all_token_ids, room, self.config.lookup_min, self.config.lookup_max
            )
        draft = _within_rules(request, draft)
        # How far to verify: the request's acceptance so far, or the draft's own confidence.
        rate = max(acceptance(request.num_accepted_tokens, request.num_rejected_drafts),
                   confidence)
        return draft[: best_length(len(draft), rate, self.cost)]

    def finished(self, request: Request) -> None:
        """A request ended: its prompt and output join the suffix corpus of its cache_salt."""
        if self.suffix is not None and request.sample_tokens and request.kv_marker is None:
            self.suffix.add(request.all_token_ids, request.cache_salt)


def _within_rules(request: Request, draft: list[int]) -> list[int]:
    """The draft up to and including its first stop token (nothing after a stop is ever
    produced), and up to the first token the request's grammar refuses (which it never
    samples). The grammar is left as it was."""
    params = request.sampling_params
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops |= request.eos_token_ids
    for i, token in enumerate(draft):
        if token in stops:
            draft = draft[: i + 1]
            break
    constraint = request.constraint
    if constraint is None or not draft:
        return draft
    taken = 0
    for token in draft:
        if constraint.is_terminated or not constraint.accept(token):
            break
        taken += 1
    constraint.rollback(taken)
    return draft[:taken]
