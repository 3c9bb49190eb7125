"""The chat route's tool-call replies: which choices are calls, as full messages and as stream
deltas (OpenAI's shapes), parsed once per choice.

Invariant: a choice is parsed only when it has finished ("stop"); one cut off by max_tokens
stays text. While streaming, a fallback-format reply is held back only until its first
non-space character shows it is not JSON; a Hermes-format reply (its calls may follow text) is
held until it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmemo.tool_calls import ParsedReply, ToolSpec, parse_reply
from kvmemo.tool_calls.render import FALLBACK


@dataclass
class ToolReplies:
    tools: list[ToolSpec]
    reply_format: str
    _parsed: dict[int, ParsedReply] = field(default_factory=dict)  # by choice index
    _streaming_text: set[int] = field(default_factory=set)  # choices decided to be text

    def parsed(self, index: int, text: str, finish_reason: str | None) -> ParsedReply | None:
        """The finished choice's reply, parsed (None while it runs or if cut off)."""
        if finish_reason != "stop":
            return None
        if index not in self._parsed:
            self._parsed[index] = parse_reply(text, self.tools, self.reply_format)
        return self._parsed[index]

    def message(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        reply = self.parsed(index, text, finish_reason)
        if reply is None or not reply.tool_calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": reply.content,
                "tool_calls": [call.as_openai() for call in reply.tool_calls]}

    def finish_reason(self, index: int, text: str, finish_reason: str | None) -> str | None:
        reply = self.parsed(index, text, finish_reason)
        return "tool_calls" if reply is not None and reply.tool_calls else finish_reason

    def delta(
        self, index: int, text: str, new: str, finish_reason: str | None
    ) -> dict[str, Any] | None:
        """The chunk's delta for a choice whose text is now `text` (`new` just arrived), or
        None to hold it back."""
        if index in self._streaming_text:
            return {"content": new} if new else {}
        if finish_reason is None:
            stripped = text.lstrip()
            if self.reply_format == FALLBACK and stripped and not stripped.startswith("{"):
                self._streaming_text.add(index)  # not a call: send what was held, then stream
                return {"content": text}
            return None
        reply = self.parsed(index, text, finish_reason)
        if reply is None or not reply.tool_calls:
            return {"content": text} if text else {}
        delta: dict[str, Any] = {"tool_calls": [
            {"index": k, **call.as_openai()} for k, call in enumerate(reply.tool_calls)
        ]}
        if reply.content:
            delta["content"] = reply.content
        return delta
