"""Incremental detokenization and stop strings for one request.

Invariant: `text` never contains a stop string (or ends with the first one, when it is to be
included); it never ends in a half-decoded character while more tokens may follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class IncrementalDetokenizer:
    """Owns the text of one output sequence."""

    tokenizer: Any  # a Hugging Face tokenizer (decode)
    stop_strings: tuple[str, ...]
    skip_special_tokens: bool = True  # special tokens (e.g. <|im_end|>) leave no text
    include_stop_str: bool = False  # the text keeps the stop string that ended it
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    stop_reason: str | None = None

    def add_token(self, token_id: int, is_last: bool, *, shown: bool = True) -> bool:
        """Append a token; return True when a stop string was hit (text is cut before it, or
        after it with include_stop_str). shown=False: the token ends the output and leaves no
        text (an EOS or stop token id, as vLLM leaves them out)."""
        if shown:
            self.token_ids.append(token_id)
        # Decoding the whole output keeps merges across token boundaries right; outputs are
        # short enough that this is cheap next to a forward pass.
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if full.endswith("\ufffd") and not is_last:
            return False  # an unfinished multi-byte character: wait for the next token
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop_strings), default=0))
        self.text = full
        for stop in self.stop_strings:
            index = full.find(stop, search_from)
            if index != -1:
                self.text = full[: index + len(stop)] if self.include_stop_str else full[:index]
                self.stop_reason = stop
                return True
        return False
