"""The chat routes' tool-call replies: which choices are calls, as full messages and as stream
events (tool_calls/stream.py), parsed once per choice.

Invariant: a choice that was not streamed is parsed only when it has finished ("stop"); one cut
off by max_tokens stays text. A streamed choice is read as it grows (ReplyReader): a call whose
name has been sent stays a call, and the finished reply reports the calls as they were streamed,
with the same ids, so the stream and the response it ends with agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmemo.tool_calls import ParsedReply, ToolSpec, parse_reply
from kvmemo.tool_calls.stream import (
    ArgumentsDelta,
    CallStarted,
    ReplyReader,
    StreamEvent,
    TextDelta,
)


@dataclass
class ToolReplies:
    tools: list[ToolSpec]
    reply_format: str
    _parsed: dict[int, ParsedReply | None] = field(default_factory=dict)  # by choice index
    _readers: dict[int, ReplyReader] = field(default_factory=dict)  # streamed choices

    def parsed(self, index: int, text: str, finish_reason: str | None) -> ParsedReply | None:
        """The finished choice's reply, parsed (None while it runs or if cut off)."""
        if index in self._parsed:
            return self._parsed[index]
        if finish_reason != "stop":
            return None
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
        calls = reply is not None and bool(reply.tool_calls)
        return "tool_calls" if calls and finish_reason == "stop" else finish_reason

    def stream(self, index: int, new: str, finish_reason: str | None) -> list[StreamEvent]:
        """The events for a choice whose reply grew by `new` (every piece, in order); its last
        ones when it has finished (called once more after that, nothing)."""
        if index in self._parsed:
            return []
        reader = self._readers.setdefault(index, ReplyReader(self.tools, self.reply_format))
        if finish_reason is None:
            return reader.read(new)
        events, self._parsed[index] = reader.finish(new, finish_reason)
        return events

    def delta(self, index: int, new: str, finish_reason: str | None) -> dict[str, Any] | None:
        """The chat chunk's delta (OpenAI's shape) for a choice whose reply grew by `new`, or
        None to hold it back."""
        delta: dict[str, Any] = {}
        parts: dict[int, dict[str, Any]] = {}  # by call index, in the order they came
        for event in self.stream(index, new, finish_reason):
            if isinstance(event, TextDelta):
                delta["content"] = delta.get("content", "") + event.text
            elif isinstance(event, CallStarted):
                parts[event.index] = {"index": event.index, **event.call.as_openai()}
            elif isinstance(event, ArgumentsDelta):
                function = parts.setdefault(event.index, {"index": event.index,
                                                          "function": {}})["function"]
                function["arguments"] = function.get("arguments", "") + event.text
        if parts:
            delta["tool_calls"] = list(parts.values())
        if not delta and finish_reason is None:
            return None
        return delta
