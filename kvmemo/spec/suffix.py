"""SuffixIndex (vLLM's `suffix` method, after SuffixDecoding, arXiv 2411.04975): the tail of a
request matched against every sequence the engine has seen under the same cache_salt and
against the request itself; the draft follows the continuation those matches agree on, as long
as the share of matches that agree stays above a floor.

One corpus per cache_salt, so a tenant never receives another's tokens as a draft (an accepted
draft is a timing signal, like a prefix hit). Memory is bounded: sequences are dropped oldest
first past a token budget or a sequence count. Each corpus indexes the end of every bigram,
so a lookup reads only the places the request's last two tokens occurred, newest first.
"""

from __future__ import annotations

import bisect
from array import array
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Matches looked at per lookup, newest first: bounds a lookup's time on a large corpus.
_MAX_CANDIDATES = 256


@dataclass
class _Corpus:
    """One cache_salt's sequences, laid end to end at global positions that only grow (the
    oldest are dropped from the front, so every live position is >= `base`)."""

    sequences: deque[np.ndarray] = field(default_factory=deque)
    starts: deque[int] = field(default_factory=deque)  # global position of each sequence
    next_start: int = 0
    num_tokens: int = 0
    # (a, b) -> global positions just after each occurrence of a, b (ascending)
    bigram_ends: dict[tuple[int, int], array] = field(default_factory=dict)

    @property
    def base(self) -> int:
        return self.starts[0] if self.starts else self.next_start

    def add(self, tokens: np.ndarray) -> None:
        start = self.next_start
        self.sequences.append(tokens)
        self.starts.append(start)
        self.next_start += len(tokens)
        self.num_tokens += len(tokens)
        values = tokens.tolist()
        for i in range(2, len(values)):  # an end with a token after it
            key = (values[i - 2], values[i - 1])
            ends = self.bigram_ends.get(key)
            if ends is None:
                ends = self.bigram_ends[key] = array("q")
            ends.append(start + i)

    def drop_oldest(self) -> None:
        tokens = self.sequences.popleft()
        self.starts.popleft()
        self.num_tokens -= len(tokens)
        values = tokens.tolist()
        base = self.base
        for i in range(2, len(values)):  # its entries are the oldest of their lists
            key = (values[i - 2], values[i - 1])
            ends = self.bigram_ends.get(key)
            if ends is None:
                continue
            cut = bisect.bisect_left(ends, base)
            if cut >= len(ends):
                del self.bigram_ends[key]
            elif cut:
                del ends[:cut]

    def candidates(self, a: int, b: int) -> list[tuple[np.ndarray, int]]:
        """(sequence, index just after an occurrence of a, b), newest first."""
        ends = self.bigram_ends.get((a, b))
        if not ends:
            return []
        out = []
        for position in reversed(ends[-_MAX_CANDIDATES:]):
            s = bisect.bisect_right(self.starts, position) - 1
            out.append((self.sequences[s], position - self.starts[s]))
        return out


class SuffixIndex:
    """Every finished sequence's tokens by cache_salt, and the draft a context's tail earns."""

    def __init__(self, *, max_depth: int, max_spec_factor: float, min_token_prob: float,
                 max_sequences: int, max_tokens: int):
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_sequences = max_sequences
        self.max_tokens = max_tokens
        self._corpora: dict[str | None, _Corpus] = {}
        self._order: deque[str | None] = deque()  # salt of each sequence, oldest first

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self._corpora.values())

    @property
    def num_sequences(self) -> int:
        return len(self._order)

    def add(self, tokens: Sequence[int], cache_salt: str | None) -> None:
        """Remember a finished sequence (prompt and output) for requests under `cache_salt`;
        the oldest sequences go once the index holds more than its bounds."""
        if len(tokens) < 3:
            return
        arr = np.asarray(tokens[-self.max_tokens :], dtype=np.int64)
        corpus = self._corpora.setdefault(cache_salt, _Corpus())
        corpus.add(arr)
        self._order.append(cache_salt)
        total = self.num_tokens
        while self._order and (total > self.max_tokens or len(self._order) > self.max_sequences):
            salt = self._order.popleft()
            oldest = self._corpora[salt]
            total -= len(oldest.sequences[0])
            oldest.drop_oldest()
            if not oldest.sequences:
                del self._corpora[salt]

    def draft(self, context: Sequence[int], cache_salt: str | None, max_tokens: int) -> list[int]:
        """The tokens that most often followed the longest match of the context's tail (in this
        salt's corpus and in the context itself), while the share of matches agreeing on each
        next token, multiplied along the draft, stays >= min_token_prob; at most max_tokens and
        max_spec_factor x the match length."""
        return self.draft_with_confidence(context, cache_salt, max_tokens)[0]

    def draft_with_confidence(
        self, context: Sequence[int], cache_salt: str | None, max_tokens: int
    ) -> tuple[list[int], float]:
        """The draft, and how likely each of its tokens is to be kept: m / (m + 1) for a match
        of m tokens whose every occurrence went on the same way (a replay), else 0 (unknown)."""
        if max_tokens <= 0 or len(context) < 3:
            return [], 0.0
        own = np.asarray(context, dtype=np.int64)
        a, b = int(own[-2]), int(own[-1])
        found: list[tuple[np.ndarray, int]] = []
        corpus = self._corpora.get(cache_salt)
        if corpus is not None:
            found.extend(corpus.candidates(a, b))
        ends = np.flatnonzero((own[:-2] == a) & (own[1:-1] == b)) + 2
        found.extend((own, int(e)) for e in ends[::-1][:_MAX_CANDIDATES])
        if not found:
            return [], 0.0
        depth = min(self.max_depth, len(own))
        lengths = [_match_length(seq, end, own, depth) for seq, end in found]
        best = max(lengths)
        matches = [f for f, n in zip(found, lengths) if n == best]
        limit = min(max_tokens, int(self.max_spec_factor * best), self.max_depth)
        draft: list[int] = []
        score = 1.0
        while len(draft) < limit and matches:
            step = len(draft)
            nexts = Counter(int(seq[end + step]) for seq, end in matches if end + step < len(seq))
            if not nexts:
                break
            token, count = nexts.most_common(1)[0]
            score *= count / len(matches)  # a match that ended votes for stopping
            if score < self.min_token_prob:
                break
            draft.append(token)
            matches = [(s, e) for s, e in matches if e + step < len(s) and s[e + step] == token]
        return draft, (best / (best + 1) if score == 1.0 else 0.0)


def _match_length(seq: np.ndarray, end: int, context: np.ndarray, depth: int) -> int:
    """How many tokens before seq[end] equal the context's last ones (at most depth)."""
    n = min(depth, end)
    if n <= 0:
        return 0
    mismatch = np.flatnonzero(seq[end - n : end][::-1] != context[len(context) - n :][::-1])
    return int(mismatch[0]) if mismatch.size else n
