"""Job: one HTTP generation request's engine stream and what it received so far (its choices'
text, token ids and logprobs gathered from delta outputs), with usage, time to first token and
the logprobs' API naming. The routes (serving_common.py and its subclasses) read it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvmemo.engine import RequestStream, StreamItem
from kvmemo.text_buffer import TextBuffer


@dataclass
class Choice:
    """One of a request's n samples as received so far: the engine streams deltas
    (RequestOutputKind.DELTA), gathered here."""

    index: int  # which of the request's n samples
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    num_logprobs_sent: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    echo_sent: bool = False  # the echoed prompt went out (text and logprobs)
    # Characters of the generated tokens whose logprobs went out (completions' text_offset).
    logprob_chars: int = 0
    received: TextBuffer = field(default_factory=TextBuffer)  # its text, from the deltas

    @property
    def text(self) -> str:
        return self.received.text

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float | None  # None for a prompt's first token (nothing predicts it)
    top: list[tuple[int, float]] | None  # (token id, logprob), best first


@dataclass
class Job:
    """One HTTP generation request: its engine stream and what it produced so far."""

    stream: RequestStream
    n: int
    top_logprobs: int | None  # None = no logprobs
    echo: bool = False  # completions: the prompt comes before the output (and its logprobs)
    echo_prefix: str = ""  # chat: the text the reply starts with (the echoed last message)
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>"
    name: str | None = None  # the client's request_id: the response id ends with it
    tool_replies: Any = None  # chat with tools: its ToolReplies (serving_chat's)
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)
    token_texts: dict[int, str] = field(default_factory=dict)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # kvmemo's usage extension: why the uncached prompt tokens were computed (miss_causes.py)
    miss_details: dict[str, Any] = field(default_factory=dict)
    num_blended_tokens: int | None = None  # kv_reuse="blend" only
    num_recomputed_tokens: int | None = None
    # Speculative decoding, per choice: (steps with a draft, drafted tokens, kept tokens).
    drafts: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    ttft_s: float | None = None
    start: float = field(default_factory=time.monotonic)
    # Per prompt token {token_id: logprob} (None for the first), once the prompt is computed,
    # for a request with prompt_logprobs (or echo with logprobs).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(self.n)]

    def update(self, item: StreamItem) -> tuple[Choice, str]:
        """Record one engine output; returns the choice and its new text."""
        out = item.output
        completion = out.outputs[0]
        choice = self.choices[item.index]
        delta = completion.text  # a delta output: only what is new
        choice.received.append(delta)
        choice.token_ids.extend(completion.token_ids)
        choice.finish_reason = completion.finish_reason
        choice.stop_reason = completion.stop_reason
        if completion.logprobs is not None:
            choice.logprobs.extend(completion.logprobs)
        self.token_texts.update(item.token_texts)
        if item.index == 0:
            if out.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = list(out.prompt_logprobs)
            self.num_prompt_tokens = out.metrics.num_prompt_tokens
            self.num_cached_tokens = out.metrics.num_cached_tokens
            self.num_blended_tokens = out.metrics.num_blended_tokens
            self.num_recomputed_tokens = out.metrics.num_recomputed_tokens
            if out.metrics.uncached_tokens_by_cause is not None:
                self.miss_details = {
                    "uncached_tokens_by_cause": out.metrics.uncached_tokens_by_cause}
                if out.metrics.diverged_at_token is not None:
                    self.miss_details["diverged_at_token"] = out.metrics.diverged_at_token
        metrics = out.metrics
        if metrics.num_drafts:
            self.drafts[item.index] = (
                metrics.num_drafts, metrics.num_draft_tokens, metrics.num_accepted_tokens
            )
        if self.ttft_s is None and out.metrics.first_token_time is not None:
            self.ttft_s = time.monotonic() - self.start
        return choice, delta

    def usage(self) -> dict[str, Any]:
        completion_tokens = sum(c.num_tokens for c in self.choices)
        details: dict[str, Any] = {"cached_tokens": self.num_cached_tokens, **self.miss_details}
        if self.num_blended_tokens is not None:
            details["blended_tokens"] = self.num_blended_tokens
            details["recomputed_tokens"] = self.num_recomputed_tokens
        usage = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.num_prompt_tokens + completion_tokens,
            "prompt_tokens_details": details,
        }
        if self.drafts:
            # OpenAI's names for predicted-output tokens: a draft is a prediction.
            drafted = sum(d for _, d, _ in self.drafts.values())
            kept = sum(a for _, _, a in self.drafts.values())
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": kept,
                "rejected_prediction_tokens": drafted - kept,
            }
        return usage

    def token_text(self, token_id: int) -> str:
        return self.token_texts.get(token_id, "")

    def logprob_token(self, token_id: int) -> str:
        """How logprobs name a token: its text, or "token_id:<id>" when asked."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self.token_text(token_id)

    def take_logprobs(self, choice: Choice) -> tuple[int, list[TokenLogprob]]:
        """The position of the first unsent logprob and the unsent ones (now marked sent)."""
        start, choice.num_logprobs_sent = choice.num_logprobs_sent, len(choice.logprobs)
        entries = []
        for i in range(start, len(choice.logprobs)):
            entry = choice.logprobs[i]
            token_id = choice.token_ids[i]
            entries.append(TokenLogprob(token_id, entry[token_id], self._top(entry)))
        return start, entries

    def prompt_entries(self) -> list[TokenLogprob]:
        """The prompt's tokens with their logprobs and top alternatives (the first has none)."""
        assert self.prompt_logprobs is not None
        entries = []
        for token_id, entry in zip(self.stream.prompt_token_ids, self.prompt_logprobs):
            if entry is None:
                entries.append(TokenLogprob(token_id, None, None))
                continue
            entries.append(TokenLogprob(token_id, entry[token_id], self._top(entry)))
        return entries

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        """An entry's top_logprobs best alternatives, best first."""
        return sorted(entry.items(), key=lambda kv: -kv[1])[: self.top_logprobs or 0]

    def prompt_logprobs_json(self) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's choice-level `prompt_logprobs`: per prompt token, {"token id": {"logprob",
        "decoded_token"}} for the token and its top alternatives; null for the first."""
        if self.prompt_logprobs is None:
            return None
        return [
            None if entry is None else {
                str(t): {"logprob": v, "decoded_token": self.token_text(t)}
                for t, v in entry.items()
            }
            for entry in self.prompt_logprobs
        ]
