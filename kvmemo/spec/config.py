"""SpeculativeConfig: which draft source, and how far it may guess (vLLM's keys, so a vLLM
`speculative_config` dict or `--speculative-config` JSON works unchanged)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

SPECULATIVE_METHODS = ("ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    # The most tokens drafted for one request in one step (suffix: at most its tree depth).
    num_speculative_tokens: int | None = None
    # ngram: the longest and shortest tail of the request matched earlier in its own tokens.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # suffix (Arctic Inference's names, as vLLM passes them): the longest match and draft,
    # how many finished requests the index keeps per cache_salt, draft length per matched token,
    # and the lowest estimated probability a drafted token may have.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # kvmemo's bound on the suffix index's memory: tokens kept over all salts (oldest
    # sequences go first).
    suffix_index_max_tokens: int = 4_000_000

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {list(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value <= 0):
                raise ValueError(
                    f"speculative_config {name} must be a positive integer, got {value!r}"
                )
        for name in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                     "suffix_index_max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(
                    f"speculative_config {name} must be a positive integer, got {value!r}"
                )
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not _is_number(factor) or factor <= 0:
            raise ValueError(
                "speculative_config suffix_decoding_max_spec_factor must be a number > 0, "
                f"got {factor!r}"
            )
        if not _is_number(prob) or not 0.0 <= prob <= 1.0:
            raise ValueError(
                "speculative_config suffix_decoding_min_token_prob must be a number in [0, 1], "
                f"got {prob!r}"
            )
        lo, hi = self.lookup_min, self.lookup_max
        if lo > hi:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({lo}) must be at most "
                f"prompt_lookup_max ({hi})"
            )

    @property
    def num_draft_tokens(self) -> int:
        """The draft length cap: num_speculative_tokens, by default 5 for ngram (kvmemo's
        choice; the policy verifies fewer where they do not pay) and the tree depth for suffix
        (vLLM's default)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return 5 if self.method == "ngram" else self.suffix_decoding_max_tree_depth

    @property
    def lookup_max(self) -> int:
        if self.prompt_lookup_max is not None:
            return self.prompt_lookup_max
        return max(5, self.prompt_lookup_min or 1)

    @property
    def lookup_min(self) -> int:
        """Shortest tail matched: 2 by default (kvmemo's choice: a tail of 1 drafts after any
        repeated token, a weaker signal; not tuned by measurement)."""
        if self.prompt_lookup_min is not None:
            return self.prompt_lookup_min
        return min(2, self.lookup_max)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a SpeculativeConfig, a dict (vLLM's `speculative_config`) or its JSON text;
        ValueError names an unknown key, a bad value or bad JSON."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(
                "speculative_config must be a dict or a JSON object such as "
                f'{{"method": "ngram", "num_speculative_tokens": 5}}, got {value!r}'
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s) {unknown}; allowed: {sorted(known)}"
            )
        if "method" not in value:
            raise ValueError(
                f"speculative_config needs a method, one of {list(SPECULATIVE_METHODS)}"
            )
        return cls(**value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
