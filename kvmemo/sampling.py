"""SamplingParams: how one request picks its next tokens (no torch here).

Invariant: a constructed SamplingParams is valid; every bad field raises ValueError naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvmemo.errors import InputError
from kvmemo.outputs import RequestOutputKind
from kvmemo.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated at construction.

    temperature 0 means greedy. top_k 0 (or None) means no top-k cut.
    """

    n: int = 1  # samples per prompt
    max_tokens: int = 16  # new tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens below min_p * p(max), in [0, 1]
    seed: int | None = None  # per-request generator: same seed, same output in any batch
    # Stop strings (not included in the text); a single string is accepted.
    stop: str | tuple[str, ...] | list[str] = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    skip_special_tokens: bool = True  # special tokens leave no text (the token ids keep them)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs to return for each sampled position
    # Log-probabilities of the prompt's tokens (each given the ones before it), with this many
    # top alternatives; the first token has none. A request asking for them computes its whole
    # prompt: cached KV has no logits to give.
    prompt_logprobs: int | None = None
    # Penalties and biases, with vLLM's names and meanings, applied to the logits before
    # temperature and the cuts (logprobs stay the model's own):
    # tokens seen in the prompt or the output: logit / p if positive, logit * p if not (1 = off)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # minus this once for every token the output holds, [-2, 2]
    frequency_penalty: float = 0.0  # minus this per occurrence in the output, [-2, 2]
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    # Words the output never contains (vLLM's bad_words): the engine tokenizes each, alone and
    # after a space, into bad_words_token_ids; a sequence's last token is banned whenever the
    # output ends with the rest of it.
    bad_words: tuple[str, ...] | list[str] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] | list[int] | None = None  # sample only among these
    # The output follows this JSON schema / regex / choice / grammar (None: free text).
    structured_outputs: StructuredOutputsParams | None = None
    # What each RequestOutput holds: everything so far, only what is new, or one final output.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        kinds = [k.value for k in RequestOutputKind]
        _check("output_kind", self.output_kind in kinds,
               f"output_kind must be one of {kinds}, got {self.output_kind!r}")
        object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        n = self.n
        _check("n", isinstance(n, int) and n >= 1, f"n must be an integer >= 1, got {n!r}")
        _check(
            "max_tokens",
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            "temperature",
            self.temperature >= 0.0,
            f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}",
        )
        _check("top_p", 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(
            "top_k",
            isinstance(self.top_k, int) and self.top_k >= 0,
            f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}",
        )
        _check("min_p", 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(
            "stop",
            all(isinstance(s, str) and s for s in self.stop_strings),
            f"stop must be a non-empty string or a list of them, got {self.stop!r}",
        )
        _check(
            "stop_token_ids",
            all(_is_token_id(t) for t in self.stop_token_ids),
            "stop_token_ids must hold non-negative integers",
        )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            _check(name, k is None or (isinstance(k, int) and 0 <= k <= 20),
                   f"{name} must be None or an integer in [0, 20], got {k!r}")
        _check(
            "seed",
            self.seed is None or isinstance(self.seed, int),
            f"seed must be an integer or None, got {self.seed!r}",
        )
        _check(
            "repetition_penalty",
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(name, _is_number(value) and -2.0 <= value <= 2.0,
                   f"{name} must be in [-2, 2], got {value!r}")
        bias = self.logit_bias
        _check(
            "logit_bias",
            bias is None or (isinstance(bias, dict) and all(
                _is_token_id(t) and _is_number(b) and -100.0 <= b <= 100.0 for t, b in bias.items()
            )),
            f"logit_bias must map token ids (integers >= 0) to biases in [-100, 100], got {bias!r}",
        )
        _check(
            "min_tokens",
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
            f"got {self.min_tokens!r}",
        )
        _check(
            "bad_words",
            all(isinstance(w, str) and w.strip() for w in self.bad_words),
            f"bad_words must be a list of non-blank strings, got {self.bad_words!r}",
        )
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        _check(
            "bad_words",
            all(
                isinstance(seq, tuple) and seq and all(_is_token_id(t) for t in seq)
                for seq in self.bad_words_token_ids
            ),
            "bad_words_token_ids must hold non-empty tuples of token ids",
        )
        allowed = self.allowed_token_ids
        _check(
            "allowed_token_ids",
            allowed is None or (len(allowed) > 0 and all(_is_token_id(t) for t in allowed)),
            f"allowed_token_ids must be None or a non-empty list of token ids, got {allowed!r}",
        )
        if allowed is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
        _check(
            "structured_outputs",
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams or None, got "
            f"{type(self.structured_outputs).__name__}",
        )

    @property
    def has_penalties(self) -> bool:
        """Any logit processing before sampling (penalties, biases, a minimum length, bans)."""
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0 or bool(self.logit_bias) or self.min_tokens > 0
            or bool(self.bad_words_token_ids) or self.allowed_token_ids is not None
        )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        return dataclasses.replace(self, max_tokens=max_tokens)

    def per_sample(self) -> list[SamplingParams]:
        """The n samples as n one-sample params: a seeded request gives sample j seed + j, so
        each sample differs and the whole request stays reproducible."""
        return [
            dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + j)
            for j in range(self.n)
        ]

    @property
    def is_greedy(self) -> bool:
        # Temperatures this small overflow logits / temperature; they mean greedy anyway.
        return self.temperature < _MIN_TEMPERATURE


_MIN_TEMPERATURE = 1e-5


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check(param: str, ok: bool, message: str) -> None:
    if not ok:
        raise InputError(param, message)
