"""TextBuffer: text that grows by appended pieces, joined only when read whole.

Why: `self.text += piece` on an attribute copies the whole string every time (CPython extends
in place only a local's), so a reply built token by token cost O(n^2). The detokenizer and the
server's per-choice text both grow this way.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TextBuffer:
    _pieces: list[str] = field(default_factory=list)
    length: int = 0

    @property
    def text(self) -> str:
        """The whole text (its pieces joined once, then kept joined)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self.length += len(piece)

    def replace(self, text: str) -> None:
        self._pieces, self.length = [text], len(text)

    def since(self, offset: int) -> str:
        """text[offset:], reading only the pieces past `offset`."""
        if offset >= self.length:
            return ""
        tail: list[str] = []
        start = self.length
        for piece in reversed(self._pieces):
            if start <= offset:
                break
            tail.append(piece)
            start -= len(piece)
        return "".join(reversed(tail))[offset - start :]
