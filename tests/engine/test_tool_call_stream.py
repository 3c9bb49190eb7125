"""The streamed reader of tool-call replies (kvmemo/tool_calls/stream.py) against the whole-reply
parser (parse.py), which is written apart from it: fed a reply in any pieces, the reader's text
and calls add up to what the parser reads from the finished reply, and each call starts as soon
as its name has been generated."""

from __future__ import annotations

import json
import random

import pytest

from kvmemo.tool_calls import parse_reply, parse_tools
from kvmemo.tool_calls.render import FALLBACK, HERMES
from kvmemo.tool_calls.stream import (
    ArgumentsDelta,
    CallEnded,
    CallStarted,
    ReplyReader,
    StreamEvent,
    TextDelta,
)
from tests.engine.test_tool_calls import TOOLS

SPECS = parse_tools(TOOLS)

REPLIES = [
    (FALLBACK, '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}'),
    (FALLBACK, ' {\n "tool_calls" : [ {"name":"add","arguments":{"a":1,"b":2}} ,\n'
               '{"name": "get_weather", "arguments": {"city": "X}{\\"", "unit": "F"}}]}\n'),
    (FALLBACK, 'Let me check.\n{"tool_calls": [{"name": "add", "arguments": {"a": [1, {"b": 2}]}}]}'),
    (FALLBACK, '{"answer": 42}'),
    (FALLBACK, '{"tool_calls": [{"name": "nope", "arguments": {}}]}'),
    (FALLBACK, '{"tool_calls": [{"arguments": {"a": 1, "b": 2}, "name": "add"}]}'),
    (FALLBACK, "Plain text answer, with {braces} and a trailing space "),
    (HERMES, 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}'
             "</tool_call>"),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'
             "</tool_call>"),
    (HERMES, "A <tool answer> that only mentions <tool_call tags."),
    (HERMES, "<tool_call>{not json}</tool_call>"),
]


def _feed(reader: ReplyReader, text: str, cuts: list[int], finish: str) -> list[StreamEvent]:
    """The reply in pieces cut at `cuts`, the last piece with the finish."""
    events: list[StreamEvent] = []
    start = 0
    for cut in cuts:
        events += reader.read(text[start:cut])
        start = cut
    last, reply = reader.finish(text[start:], finish)
    assert reader.finish("", finish) == ([], reply), "finishing twice adds nothing"
    return events + last


def _assemble(events: list[StreamEvent]) -> tuple[str, list[tuple[str, str, str]]]:
    """(text, [(id, name, arguments)]) as a client adds the events up."""
    text, calls = "", {}
    ended = set()
    for e in events:
        if isinstance(e, TextDelta):
            assert not calls, "text after a call"
            text += e.text
        elif isinstance(e, CallStarted):
            assert e.index == len(calls) and not e.call.arguments
            calls[e.index] = [e.call.id, e.call.name, ""]
        elif isinstance(e, ArgumentsDelta):
            assert e.index in calls and e.index not in ended
            calls[e.index][2] += e.text
        else:
            assert isinstance(e, CallEnded) and e.index in calls
            ended.add(e.index)
    assert ended == set(calls), "every started call ends"
    return text, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize(("reply_format", "text"), REPLIES)
def test_any_pieces_add_up_to_the_whole_parse(reply_format, text):
    expected = parse_reply(text, SPECS, reply_format)
    rng = random.Random(7)
    splits = [list(range(1, len(text) + 1)), []] + [
        sorted(rng.sample(range(1, len(text)), k)) for k in (1, 3, 9) for _ in range(3)]
    for cuts in splits:
        reader = ReplyReader(SPECS, reply_format)
        events = _feed(reader, text, cuts, "stop")
        streamed_text, calls = _assemble(events)
        _, reply = reader.finish("", "stop")
        if expected.tool_calls:
            assert streamed_text.strip() == (expected.content or "")
            assert [(n, json.loads(a)) for _, n, a in calls] == [
                (c.name, json.loads(c.arguments)) for c in expected.tool_calls]
            assert reply is not None and [c.id for c in reply.tool_calls] == [i for i, _, _ in calls]
        else:
            assert streamed_text == text and calls == []


def test_arguments_are_the_models_own_text():
    text = ('{"tool_calls": [{"name": "add", "arguments": {"a":1,  "b":2}}]}')
    reader = ReplyReader(SPECS, FALLBACK)
    _, calls = _assemble(_feed(reader, text, list(range(1, len(text))), "stop"))
    assert calls[0][2] == '{"a":1,  "b":2}' == parse_reply(text, SPECS, FALLBACK).tool_calls[0].arguments


@pytest.mark.parametrize("reply_format", [FALLBACK, HERMES])
def test_a_call_starts_when_its_arguments_open(reply_format):
    body = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
    text = ('{"tool_calls": [' + body + "]}") if reply_format == FALLBACK \
        else "<tool_call>" + body + "</tool_call>"
    opens = text.index('{"city"') + 1
    reader = ReplyReader(SPECS, reply_format)
    assert reader.read(text[:opens - 1]) == []
    started = [e for e in reader.read(text[opens - 1]) if isinstance(e, CallStarted)]
    assert [e.call.name for e in started] == ["get_weather"]
    # The arguments go out as they are written, before the reply ends.
    assert reader.read(text[opens:text.index("Oslo") + 2]) == [ArgumentsDelta(0, '"city": "Os')]


def test_text_streams_until_it_may_open_a_call():
    reader = ReplyReader(SPECS, HERMES)
    assert reader.read("Let me look. ") == [TextDelta("Let me look.")]
    assert reader.read("<tool_") == []  # maybe a call's opening: held
    assert reader.read("box> is") == [TextDelta(" <tool_box> is")]
    fallback = ReplyReader(SPECS, FALLBACK)
    assert fallback.read("  {") == []  # a reply that opens as JSON may be a call
    assert ReplyReader(SPECS, FALLBACK).read("  Sure") == [TextDelta("  Sure")]


def test_a_call_cut_off_stays_a_call():
    text = '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b'
    reader = ReplyReader(SPECS, FALLBACK)
    streamed, calls = _assemble(_feed(reader, text, [10, 40], "length"))
    _, reply = reader.finish("", "length")
    assert streamed == "" and calls[0][1:] == ("add", '{"a": 1, "b')
    assert reply is not None and reply.tool_calls[0].arguments == '{"a": 1, "b'
    # Cut off before any call started: text, as the whole parse leaves it.
    early = ReplyReader(SPECS, FALLBACK)
    assert _assemble(_feed(early, text[:20], [5], "length")) == (text[:20], [])
