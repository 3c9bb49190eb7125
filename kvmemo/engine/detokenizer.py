"""Incremental detokenization and stop strings for one request.

Invariant: `text` equals the tokenizer's decode of all shown tokens (cut at a stop string), and
a token costs the same at the 4,000th as at the 10th: each step decodes only a window of the
last few tokens, the text before it is settled. It never ends in a half-decoded character while
more tokens may follow, and never contains a stop string (or ends with the first one, when it is
to be included).

Why a window, not the last token alone: a token's text can depend on its neighbours (byte-level
BPE splits a UTF-8 character over tokens, SentencePiece strips a leading space at the start of a
decode), so each step decodes [prefix_offset:] and keeps what it adds to [prefix_offset:
read_offset], the tokens already settled in the text (vLLM's scheme). Where the window's decode
does not extend its prefix's (a tokenizer whose decode is not local), the whole output is
decoded again: the text stays exact, at the old cost for that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmemo.text_buffer import TextBuffer


@dataclass
class IncrementalDetokenizer:
    """Owns the text of one output sequence."""

    tokenizer: Any  # a Hugging Face tokenizer (decode)
    stop_strings: tuple[str, ...]
    skip_special_tokens: bool = True  # special tokens (e.g. <|im_end|>) leave no text
    include_stop_str: bool = False  # the text keeps the stop string that ended it
    token_ids: list[int] = field(default_factory=list)
    stop_reason: str | None = None
    num_decoded_tokens: int = 0  # token ids passed to decode so far (the cost, for tests)
    _prefix_offset: int = 0  # the window starts here: tokens before it are settled in `text`
    _read_offset: int = 0  # tokens [_prefix_offset, _read_offset) are in `text` too
    _buffer: TextBuffer = field(default_factory=TextBuffer)  # the text (O(1) per token)

    @property
    def text(self) -> str:
        """The text so far (cut at a stop string)."""
        return self._buffer.text

    @property
    def length(self) -> int:
        return self._buffer.length

    def text_since(self, offset: int) -> str:
        """text[offset:], reading only what was added past `offset` (a streamed delta's cost)."""
        return self._buffer.since(offset)

    @property
    def held_back(self) -> int:
        """Characters at the end of the text that a stop string may still cut (its length - 1):
        a stream sends them only once the next tokens settle them."""
        if self.stop_reason is not None or not self.stop_strings:
            return 0
        return max(len(s) for s in self.stop_strings) - 1

    def add_token(self, token_id: int, is_last: bool, *, shown: bool = True) -> bool:
        """Append a token; return True when a stop string was hit (text is cut before it, or
        after it with include_stop_str). shown=False: the token ends the output and leaves no
        text (an EOS or stop token id, as vLLM leaves them out)."""
        if shown:
            self.token_ids.append(token_id)
        window = self._decode(self.token_ids[self._prefix_offset :])
        if window.endswith("\ufffd") and not is_last:
            return False  # an unfinished multi-byte character: wait for the next token
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        search_from = max(0, self.length - max((len(s) for s in self.stop_strings), default=0))
        if window.startswith(prefix):
            added: str | None = window[len(prefix) :]
            self._buffer.append(added or "")
        else:  # the window's decode rewrote its prefix's: decode everything, exactly
            self._buffer.replace(self._decode(self.token_ids))
            added, search_from = None, 0  # earlier text may have changed: search all of it
        # A step that added no text (a skipped special token) keeps its window: started at that
        # token, the next window would decode without the text before it, and a decoder that
        # strips a decode's leading space (Llama's, Mistral's) would drop the next word's.
        if added != "":
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        if not self.stop_strings:
            return False
        searched = self.text_since(search_from)
        for stop in self.stop_strings:
            index = searched.find(stop)
            if index != -1:
                end = search_from + index + (len(stop) if self.include_stop_str else 0)
                self._buffer.replace(self.text[:end])
                self.stop_reason = stop
                return True
        return False

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        self.num_decoded_tokens += len(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
