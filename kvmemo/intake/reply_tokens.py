"""The token ids the engine generated for recent replies, by their text.

A chat client sends the model's earlier answers back as text. Re-tokenizing that text need not
give the tokens the model produced (a constrained or sampled reply may split "{\"" where the
tokenizer would not), and one changed token makes every later block of the conversation miss
the prefix cache. So the intake renders a known reply with the ids it was generated as: turn
N+1's prompt then starts with exactly turn N's prompt and answer tokens.

Invariant: an entry maps a text to ids that decode to exactly that text; it is a bounded LRU.
Entries are kept per cache_salt: whether a text is known changes how a prompt tokenizes (and so
its usage count), which must not tell one tenant what another was answered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

_MAX_ENTRIES = 4096
_MAX_TEXT_CHARS = 64 * 1024  # longer replies are rare in agent turns; not worth the memory


class ReplyTokenCache:
    """Owns the text -> token ids map (thread-safe: the engine fills it, intake reads it)."""

    def __init__(self, max_entries: int = _MAX_ENTRIES):
        self._entries: OrderedDict[tuple[str | None, str], tuple[int, ...]] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self.hits = 0

    def remember(self, text: str, token_ids: Sequence[int], salt: str | None = None) -> None:
        if not text or not token_ids or len(text) > _MAX_TEXT_CHARS:
            return
        key = (salt, text)
        with self._lock:
            self._entries[key] = tuple(token_ids)
            self._entries.move_to_end(key)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def get(self, text: str, salt: str | None = None) -> tuple[int, ...] | None:
        key = (salt, text)
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return ids

    def __len__(self) -> int:
        return len(self._entries)
