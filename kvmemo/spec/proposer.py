"""DraftProposer: the draft each running request takes into its next step, from the source its
SpeculativeConfig names, cut so that verifying it can never run past what the request may
produce (max_tokens, the context, a stop token, its grammar)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvmemo.request import Request, RequestStatus
from kvmemo.spec.config import SpeculativeConfig
from kvmemo.spec.corpus_log import CorpusLog, CorpusRecord
from kvmemo.spec.ngram import ngram_draft
from kvmemo.spec.policy import CPU_NATIVE_COST, acceptance, best_length
from kvmemo.spec.replay import ReplayIndex, replayable, run_key
from kvmemo.spec.suffix import SuffixIndex

logger = logging.getLogger(__name__)


class DraftProposer:
    """Owns the suffix index (method "suffix") and the per-step draft of each request."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 cost: Sequence[float] = CPU_NATIVE_COST, log: CorpusLog | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.cost = tuple(cost)  # a step verifying k drafts, in plain steps (policy.py)
        self._pays: dict[int, bool] = {}  # rows -> whether any draft can pay (_drafts_can_pay)
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
        # Whole earlier greedy runs of the same prompt: a suffix corpus's exact replays.
        self.replays = (
            ReplayIndex(config.suffix_index_max_tokens) if config.method == "suffix" else None
        )
        # The corpus saved beside a disk KV store (suffix only): read back, then appended to.
        self.log = log if self.suffix is not None else None
        if self.log is not None:
            count = 0
            for record in self.log.read():
                self._learn(record)
                count += 1
            if count:
                logger.info("speculative corpus: %d sequences from %s", count, self.log.path)

    def propose(self, request: Request, rows: int = 1) -> list[int]:
        """The draft for `request`'s next step ([] for a sequence speculation ignores: a beam,
        a blend's chunks or blended prompt); `rows`: the sequences that step decodes, this one
        included (the policy prices a draft against them)."""
        if not request.sample_tokens or request.blend is not None or request.kv_marker:
            return []
        params = request.sampling_params
        room = min(
            self.config.num_draft_tokens,
            params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if room <= 0 or not self._drafts_can_pay(rows):
            return []
        if self.replays is not None:
            # A replay is not capped by num_speculative_tokens: the whole rest of the earlier
            # run (as far as the step's budget) is one draft, verified in one step.
            replay = self.replays.draft(request, min(
                params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            ))
            if replay:
                return _within_rules(request, replay)
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
        return draft[: best_length(len(draft), rate, self.cost, rows)]

    def _drafts_can_pay(self, rows: int) -> bool:
        """Whether a draft kept whole could beat a plain step of `rows` sequences. Why ask
        first: looking a draft up costs Python time per request and step (the suffix tree,
        the replays), which a step too full for any draft would pay for nothing."""
        if rows not in self._pays:
            self._pays[rows] = best_length(self.config.num_draft_tokens, 1.0, self.cost, rows) > 0
        return self._pays[rows]

    def finished(self, request: Request) -> None:
        """A request ended: its prompt and output join the suffix corpus of its cache_salt
        (and the saved corpus); a plain greedy run becomes a replay of its prompt."""
        if self.suffix is None or not request.sample_tokens or request.kv_marker is not None:
            return
        record = CorpusRecord(
            salt=request.cache_salt,
            prompt=list(request.prompt_token_ids),
            output=list(request.output_token_ids),
            mm_hashes=[item.content_hash for item in request.mm_items],
            greedy=replayable(request) and request.status != RequestStatus.FINISHED_ABORTED,
        )
        self._learn(record)
        if self.log is not None:
            self.log.append(record)

    def _learn(self, record: CorpusRecord) -> None:
        assert self.suffix is not None and self.replays is not None
        self.suffix.add(record.prompt + record.output, record.salt)
        if record.greedy:
            self.replays.add_run(run_key(record.salt, record.prompt, record.mm_hashes),
                                 record.output)


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
