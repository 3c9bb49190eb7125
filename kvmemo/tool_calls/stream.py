"""A reply that may hold tool calls, read while it is generated: its text streams as it comes, a
call starts as soon as its name is read and its arguments open, and the arguments stream as the
model writes them. Every route that streams (chat completions, Messages, Responses) maps these
events to its own wire shapes.

Why: holding a reply until it ends (to parse its calls whole) makes the client's first event
wait for the whole decode: an agent's time to first token then grows with its tool call's
length. vLLM's and Anthropic's servers stream a call's name and argument fragments as they come.

Invariant: nothing emitted is taken back. The reader follows the canonical shapes, the ones
parse.py reads and the fallback prompt asks for:
- fallback: optional text, then {"tool_calls": [{"name": ..., "arguments": {...}}, ...]};
- hermes: optional text, then <tool_call>{"name": ..., "arguments": {...}}</tool_call>, ...
Text is held back only while it may begin a call's opening, and its trailing whitespace (the
full parse strips it). A reply that leaves these shapes before any call has started is held
from there to its end and parsed whole, as the non-streamed answer is (`finish`). A call that
names a defined tool and has opened its arguments stays a call to the end, even if the reply
is cut off (Anthropic and vLLM do the same); its arguments are the model's own text.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

from kvmemo.text_buffer import TextBuffer
from kvmemo.tool_calls.parse import ParsedReply, parse_reply
from kvmemo.tool_calls.render import FALLBACK
from kvmemo.tool_calls.spec import ToolCall, ToolSpec


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int  # of the call in the reply
    call: ToolCall  # its name and id (arguments still empty)


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnded:
    index: int


StreamEvent = TextDelta | CallStarted | ArgumentsDelta | CallEnded


class _Left(Exception):
    """The reply left the shape the reader follows."""


@dataclass
class _Call:
    name: str
    id: str
    arguments: TextBuffer = field(default_factory=TextBuffer)
    ended: bool = False


# A generator fed one character per send(); what it returns is never used.
_Reader = Generator[None, str, None]


@dataclass
class ReplyReader:
    """One choice's reply, read as it grows (`read`), then closed (`finish`)."""

    tools: Sequence[ToolSpec]
    reply_format: str
    _read: TextBuffer = field(default_factory=TextBuffer)  # the reply as read so far
    _emitted: TextBuffer = field(default_factory=TextBuffer)  # the text sent: a prefix of it
    _calls: list[_Call] = field(default_factory=list)
    _events: list[StreamEvent] = field(default_factory=list)
    _held: str = ""  # text read but not sent (it may begin a call's opening)
    _stopped: bool = False  # left the shape, or the calls are over: read no further
    _reply_read: ParsedReply | None = None  # set by finish
    _finished: bool = False

    def __post_init__(self) -> None:
        self._names = {t.name for t in self.tools}
        self._opening = '{"tool_calls"' if self.reply_format == FALLBACK else "<tool_call>"
        self._machine = self._reply()
        next(self._machine)

    def read(self, new: str) -> list[StreamEvent]:
        """The events for the reply grown by `new` (pieces, not the whole text: a reply read
        token by token costs its length once)."""
        self._read.append(new)
        for ch in new:
            if self._stopped:
                break
            try:
                self._machine.send(ch)
            except (_Left, StopIteration):
                self._stopped = True
        events, self._events = self._events, []
        return events

    def finish(self, new: str, finish_reason: str | None) -> tuple[list[StreamEvent],
                                                                   ParsedReply | None]:
        """The last events, and the reply as the answer reports it: its calls as streamed, or,
        when no call started, the whole reply parsed (None: cut off before any call). Once
        finished, the same reply and no more events."""
        if self._finished:
            return [], self._reply_read
        self._finished = True
        events, self._reply_read = self._close(new, finish_reason)
        return events, self._reply_read

    def _close(self, new: str, finish_reason: str | None) -> tuple[list[StreamEvent],
                                                                   ParsedReply | None]:
        events = self.read(new)
        text, emitted = self._read.text, self._emitted.text
        if self._calls:
            last = len(self._calls) - 1
            if not self._calls[last].ended:
                self._calls[last].ended = True
                events.append(CallEnded(last))
            calls = [ToolCall(c.name, c.arguments.text, c.id) for c in self._calls]
            return events, ParsedReply(emitted.strip() or None, calls)
        parsed = parse_reply(text, self.tools, self.reply_format) \
            if finish_reason == "stop" else None
        if parsed is None or not parsed.tool_calls:
            rest = text[len(emitted):]
            if rest:
                events.append(TextDelta(rest))
            return events, parsed
        content = parsed.content or ""
        if content.startswith(emitted) and len(content) > len(emitted):
            events.append(TextDelta(content[len(emitted):]))
        for index, call in enumerate(parsed.tool_calls):
            events += [CallStarted(index, ToolCall(call.name, "", call.id)),
                       ArgumentsDelta(index, call.arguments), CallEnded(index)]
        return events, parsed

    # ---- the reader --------------------------------------------------------------------------

    def _emit(self, event: StreamEvent) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta):
            self._events[-1] = TextDelta(last.text + event.text)
        elif isinstance(event, ArgumentsDelta) and isinstance(last, ArgumentsDelta) \
                and last.index == event.index:
            self._events[-1] = ArgumentsDelta(event.index, last.text + event.text)
        else:
            self._events.append(event)

    def _send_text(self, upto: int) -> None:
        """Send the held text's first `upto` characters."""
        if upto > 0:
            self._emitted.append(self._held[:upto])
            self._emit(TextDelta(self._held[:upto]))
            self._held = self._held[upto:]

    def _reply(self) -> _Reader:
        started = False  # a non-space character was read
        while True:  # text, until a call's opening
            ch = yield
            if self.reply_format == FALLBACK and ch == "{" and not started:
                yield from self._token('"tool_calls"')  # a reply that starts as JSON
                break
            started = started or not ch.isspace()
            self._held += ch
            at = self._held.find(self._opening)
            if at >= 0:
                self._send_text(len(self._held[:at].rstrip()))
                self._held = ""
                break
            self._send_text(_sendable(self._held, self._opening))
        if self.reply_format == FALLBACK:
            yield from self._token(":")
            yield from self._token("[")
            while True:
                yield from self._call()
                if (yield from self._one_of(",]")) == "]":
                    break
            yield from self._token("}")
        else:
            while True:
                yield from self._call()
                yield from self._token("</tool_call>")
                yield from self._token("<tool_call>")  # another call, or the reader stops
        self._stopped = True

    def _call(self) -> _Reader:
        """{"name": "<a defined tool>", "arguments": {...}}: started once its arguments open
        (a call whose arguments are a JSON string is left to the whole parse)."""
        yield from self._token("{")
        yield from self._token('"name"')
        yield from self._token(":")
        name = yield from self._string()
        if name not in self._names:
            raise _Left
        yield from self._token(",")
        yield from self._token('"arguments"')
        yield from self._token(":")
        ch = yield from _after_space()
        if ch != "{":
            raise _Left
        index = len(self._calls)
        call = ToolCall(name, "")
        self._calls.append(_Call(name, call.id))
        self._emit(CallStarted(index, call))
        yield from self._arguments(index, ch)
        yield from self._token("}")
        self._calls[index].ended = True
        self._emit(CallEnded(index))

    def _arguments(self, index: int, ch: str) -> _Reader:
        """A JSON object from its opening `ch`, every character sent as the model writes it."""
        depth, in_string, escaped = 0, False, False
        while True:
            self._calls[index].arguments.append(ch)
            self._emit(ArgumentsDelta(index, ch))
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return
            ch = yield

    def _token(self, literal: str) -> _Reader:
        """Whitespace, then exactly `literal`."""
        ch = yield from _after_space()
        for k, want in enumerate(literal):
            if k:
                ch = yield
            if ch != want:
                raise _Left

    def _one_of(self, chars: str) -> Generator[None, str, str]:
        ch = yield from _after_space()
        if ch not in chars:
            raise _Left
        return ch

    def _string(self) -> Generator[None, str, str]:
        ch = yield from _after_space()
        if ch != '"':
            raise _Left
        raw, escaped = '"', False
        while True:
            ch = yield
            raw += ch
            if ch == '"' and not escaped:
                try:
                    value = json.loads(raw)
                except ValueError:
                    raise _Left from None
                return value if isinstance(value, str) else ""
            escaped = not escaped and ch == "\\"


def _after_space() -> Generator[None, str, str]:
    ch = yield
    while ch.isspace():
        ch = yield
    return ch


def _sendable(held: str, opening: str) -> int:
    """How much of the held text can go out: not a tail that may begin the opening, nor the
    whitespace before such a tail or at the end (a call's opening may follow it)."""
    keep = 0
    for k in range(min(len(held), len(opening) - 1), 0, -1):
        if opening.startswith(held[-k:]):
            keep = k
            break
    cut = len(held) - keep
    while cut > 0 and held[cut - 1].isspace():
        cut -= 1
    return cut
