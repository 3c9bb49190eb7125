"""What users and the server see of a request: text, token ids, finish reason and metrics.

Invariant: num_cached_tokens <= num_prompt_tokens; ttft_s is None until the first token exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RequestOutputKind(str, Enum):
    """What each RequestOutput of a request holds (vLLM's names).

    CUMULATIVE: everything so far (text, token ids, logprobs), after every token.
    DELTA: only what is new since the request's previous output (a stream: each token costs the
    same at the 4,000th as at the 10th); prompt logprobs once, in the first. Text a stop string
    may still cut is held back until the next tokens settle it, so the deltas add up to the
    final text.
    FINAL_ONLY: one output, when the request finishes (LLM.generate's).
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "tool_calls" | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Per generated token: {token_id: logprob} holding the sampled token and the top-k.
    logprobs: list[dict[int, float]] | None = None
    # Beam search: the sum of the generated tokens' logprobs, and the beam's ranking score
    # cumulative_logprob / len(token_ids) ** length_penalty (None for sampled outputs).
    cumulative_logprob: float | None = None
    score: float | None = None
    # LLM.chat with tools: the calls this reply makes, OpenAI's form ({"id", "type": "function",
    # "function": {"name", "arguments"}}); finish_reason is then "tool_calls".
    tool_calls: list[dict] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from a cache instead of computed
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # A segmented prompt run with kv_reuse="blend" (None otherwise): prompt tokens whose KV
    # came from cached chunks as is, and prompt tokens computed (the rest were prefix hits).
    num_blended_tokens: int | None = None
    num_recomputed_tokens: int | None = None
    # Speculative decoding: steps that verified a draft, drafted tokens verified, and how many
    # of them were kept (each kept token is a decode step saved).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Why the uncached prompt tokens were computed (kvmemo/kv/miss_causes.py): tokens by cause
    # (they add up to num_prompt_tokens - num_cached_tokens; other_salt shows as never_seen
    # here, MissReport.for_the_client), and the token where the prompt
    # left a cached chain; None before its first schedule and for blended prompts
    uncached_tokens_by_cause: dict[str, int] | None = None
    diverged_at_token: int | None = None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Per prompt token, {token_id: logprob} with that token and the top alternatives; None for
    # the first token (nothing predicts it). Set when SamplingParams.prompt_logprobs is.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    extra: dict = field(default_factory=dict)
