"""OutputProcessor: a step's sampled tokens become what callers see (vLLM draws the same line).

Owns each request's output state: its incremental detokenizer (text, stop strings), the logprob
entries, prompt logprobs, grammar acceptance, and what was already sent, so it can build the
RequestOutput each request's output kind asks for (SamplingParams.output_kind): cumulative,
delta or final only. A delta output carries only what is new, so streaming a token costs the
same at the 4,000th as at the 10th.

Invariant: a request is here from add() until its final output (or abort); the scheduler owns
its lifecycle, this only asks it to finish a request (a stop string, a broken grammar).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmemo.engine.beam_search import BeamSearch
from kvmemo.engine.detokenizer import IncrementalDetokenizer
from kvmemo.engine.sampler import SampledToken
from kvmemo.intake.reply_tokens import ReplyTokenCache
from kvmemo.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from kvmemo.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """Output-side state of one request: its text so far and what the caller was sent."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    beam_search: BeamSearch | None = None
    # Per prompt token (the first has none), when prompt logprobs were asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    blended: bool = False  # a segmented prompt run with kv_reuse="blend"
    # Delta outputs: how much of the text, token ids and logprobs went out already.
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_prompt_logprobs: bool = False
    num_taken: int = 0  # output tokens taken into the text and logprobs so far

    @property
    def kind(self) -> RequestOutputKind:
        return self.request.sampling_params.output_kind


class OutputProcessor:
    """Turns each step's tokens into RequestOutputs, per request and output kind."""

    def __init__(self, tokenizer: object, reply_tokens: ReplyTokenCache,
                 finish: Callable[[str, RequestStatus], None]):
        self.tokenizer = tokenizer
        self.reply_tokens = reply_tokens  # what the intake splices back into later prompts
        self._finish = finish  # the scheduler's finish_request
        self.states: dict[str, RequestState] = {}

    def add(self, request: Request, *, blended: bool = False,
            beam_search: BeamSearch | None = None) -> None:
        params = request.sampling_params
        if beam_search is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, ())
        else:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.stop_strings, params.skip_special_tokens,
                params.include_stop_str_in_output,
            )
        self.states[request.request_id] = RequestState(
            request=request,
            detokenizer=detokenizer,
            logprobs=[] if params.logprobs is not None and beam_search is None else None,
            beam_search=beam_search,
            prompt_logprobs=(
                [None] * request.num_prompt_tokens
                if params.prompt_logprobs is not None and beam_search is None else None
            ),
            blended=blended,
        )

    def get(self, request_id: str) -> RequestState | None:
        return self.states.get(request_id)

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def record_prompt_logprobs(
        self, entries_by_request: Mapping[str, tuple[int, Sequence[dict[int, float] | None]]]
    ) -> None:
        """Prompt logprobs a step computed, by position (a preempted request recomputes its
        prompt and rewrites the same)."""
        for request_id, (first, entries) in entries_by_request.items():
            state = self.states.get(request_id)
            if state is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs[first : first + len(entries)] = entries

    def process(self, touched: list[Request], sampled: dict[str, list[SampledToken]],
                ended_searches: list[BeamSearch], now: float) -> list[RequestOutput]:
        """The outputs of one step: one per request that got tokens or finished (as its kind
        allows), then one per beam search that ended."""
        outputs = []
        for request in touched:
            state = self.states[request.request_id]
            if request.first_token_time is None:
                request.first_token_time = now
            # The scheduler appended these (fewer than sampled when a stop token came first).
            new = request.num_output_tokens - state.num_taken
            for n, token in enumerate(sampled[request.request_id][:new]):
                is_last = n == new - 1
                state.num_taken += 1
                if self._take_token(state, token, is_last) and not is_last:
                    # A stop string inside a verified draft: what followed is not produced.
                    request.truncate_output(state.num_taken)
                    break
            out = self._make_output(state, now)
            if out is not None:
                outputs.append(out)
            if request.is_finished:
                del self.states[request.request_id]
        for search in ended_searches:
            state = self.states.pop(search.root.request_id)
            outputs.append(self._make_beam_output(state, now))
        return outputs

    def _take_token(self, state: RequestState, token: SampledToken, is_last: bool) -> bool:
        """Takes one new token (is_last: the step's last for this request) into the text and
        logprobs; True when a stop string ended the output at it."""
        request = state.request
        ending = is_last and request.is_finished
        if request.constraint is not None and not request.constraint.accept(token.token_id):
            # Only a sampler fallback (a row left with no usable probability) gets here.
            logger.error("request %s: token %d breaks its grammar; stopping it",
                         request.request_id, token.token_id)
            self._finish(request.request_id, RequestStatus.FINISHED_STOPPED)
        if state.logprobs is not None:
            assert token.logprob is not None, "the sampler returns it when logprobs is set"
            entry = dict(token.top_logprobs or {})
            entry[token.token_id] = token.logprob
            state.logprobs.append(entry)
        # The EOS or stop token id that ended the output leaves no text (vLLM's rule), unless
        # the stop is to be included.
        shown = not (
            ending
            and request.status == RequestStatus.FINISHED_STOPPED
            and request.stop_reason == token.token_id
            and not request.sampling_params.include_stop_str_in_output
        )
        if state.detokenizer.add_token(token.token_id, is_last=ending, shown=shown):
            request.stop_reason = state.detokenizer.stop_reason
            self._finish(request.request_id, RequestStatus.FINISHED_STOPPED)
            return True
        if not shown:  # ended by EOS or a stop token id: the text is all of the rest
            self.reply_tokens.remember(
                state.detokenizer.text, request.output_token_ids[:-1], request.cache_salt
            )
        return False

    def _make_output(self, state: RequestState, now: float) -> RequestOutput | None:
        request = state.request
        kind = state.kind
        if kind == RequestOutputKind.FINAL_ONLY and not request.is_finished:
            return None
        if kind == RequestOutputKind.DELTA:
            return self._delta_output(state, now)
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=state.logprobs,
        )
        return self._request_output(state, [completion], state.prompt_logprobs, now)

    def _delta_output(self, state: RequestState, now: float) -> RequestOutput | None:
        """What is new since the last output: text settled past the stop strings' reach,
        the token ids and logprob entries of this step (none if nothing at all is new)."""
        request, detokenizer = state.request, state.detokenizer
        finished = request.is_finished
        settled = detokenizer.length - (0 if finished else detokenizer.held_back)
        text = detokenizer.text_since(state.sent_chars)[: max(0, settled - state.sent_chars)]
        state.sent_chars = max(state.sent_chars, settled) if not finished else detokenizer.length
        output_ids = request.output_token_ids
        new_ids = output_ids[state.sent_tokens :]
        logprobs = None
        if state.logprobs is not None:
            logprobs = state.logprobs[state.sent_tokens :]
        state.sent_tokens = len(output_ids)
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not state.sent_prompt_logprobs:
            prompt_logprobs, state.sent_prompt_logprobs = state.prompt_logprobs, True
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=new_ids,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
        )
        return self._request_output(state, [completion], prompt_logprobs, now)

    def _request_output(self, state: RequestState, completions: list[CompletionOutput],
                        prompt_logprobs: list[dict[int, float] | None] | None,
                        now: float) -> RequestOutput:
        request = state.request
        metrics = RequestMetrics(
            arrival_time=request.arrival_time,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            first_token_time=request.first_token_time,
            finished_time=now if request.is_finished else None,
            num_preemptions=request.num_preemptions,
            num_drafts=request.num_drafts,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )
        if request.miss_report is not None and not state.blended:
            metrics.uncached_tokens_by_cause = request.miss_report.for_the_client()
            metrics.diverged_at_token = request.miss_report.diverged_at
        if state.blended:
            spec = request.blend
            reused = spec.num_reused_tokens if spec is not None else 0
            metrics.num_blended_tokens = reused
            metrics.num_recomputed_tokens = (
                request.num_prompt_tokens - metrics.num_cached_tokens - reused
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt_text,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.is_finished,
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
        )

    def _make_beam_output(self, state: RequestState, now: float) -> RequestOutput:
        request, search = state.request, state.beam_search
        assert search is not None
        request.first_token_time = request.first_token_time or now
        decode = self.tokenizer.decode  # type: ignore[attr-defined]
        completions = [
            CompletionOutput(
                index=i,
                text=decode(beam.request.output_token_ids, skip_special_tokens=True),
                token_ids=list(beam.request.output_token_ids),
                finish_reason="stop" if beam.ended_with_eos else "length",
                stop_reason=beam.request.output_token_ids[-1] if beam.ended_with_eos else None,
                cumulative_logprob=beam.cumulative_logprob,
                score=beam.score,
            )
            for i, beam in enumerate(search.finished)
        ]
        return self._request_output(state, completions, state.prompt_logprobs, now)
