"""A model's reply back into OpenAI tool calls: the fallback's JSON, or Hermes-style tags.

Invariant: parsing never raises. A reply that is not a well-formed call to a defined tool
comes back as plain text content (an `auto` choice may answer in text; a malformed call must
not become a 500).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmemo.tool_calls.render import FALLBACK
from kvmemo.tool_calls.spec import ToolCall, ToolSpec

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # text outside the calls (None when the reply is only calls)
    tool_calls: list[ToolCall] = field(default_factory=list)


def parse_reply(text: str, tools: Sequence[ToolSpec], reply_format: str) -> ParsedReply:
    names = {t.name for t in tools}
    calls = _fallback_calls(text, names) if reply_format == FALLBACK else _hermes_calls(text, names)
    if calls is None:
        return ParsedReply(text)
    content, parsed = calls
    return ParsedReply(content or None, parsed)


def _fallback_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]] | None:
    """{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}, alone (after optional text
    on lines before it); arguments keep the model's own text."""
    start = text.find('{"tool_calls"')
    if start == -1:
        stripped = text.lstrip()
        start = len(text) - len(stripped) if stripped.startswith("{") else -1
    if start == -1:
        return None
    try:
        members, end = _object_spans(text, start)
        if text[end:].strip() or set(members) != {"tool_calls"}:
            return None
        array_start, _ = members["tool_calls"]
        calls = []
        for item_start in _array_item_starts(text, array_start):
            fields, _ = _object_spans(text, item_start)
            name_start, name_end = fields["name"]
            name = json.loads(text[name_start:name_end])
            args_start, args_end = fields["arguments"]
            arguments = text[args_start:args_end]
            if name not in names or not isinstance(json.loads(arguments), dict):
                return None
            calls.append(ToolCall(name, arguments))
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return (text[:start].strip(), calls) if calls else None


def _hermes_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]] | None:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, each; arguments keep the
    model's own text (as the stream sends them), or, given as a JSON string, its object."""
    bodies = _HERMES.findall(text)
    if not bodies:
        return None
    calls = []
    for body in bodies:
        try:
            fields, end = _object_spans(body, 0)
            if body[end:].strip():
                return None
            name = json.loads(body[slice(*fields["name"])])
            arguments = body[slice(*fields["arguments"])] if "arguments" in fields else "{}"
            value = json.loads(arguments)
            if isinstance(value, str):
                value = json.loads(value)
                arguments = json.dumps(value, ensure_ascii=False)
        except (ValueError, KeyError, IndexError, TypeError):
            return None
        if not isinstance(name, str) or name not in names or not isinstance(value, dict):
            return None
        calls.append(ToolCall(name, arguments))
    return text[: text.find("<tool_call>")].strip(), calls


def _skip(text: str, pos: int) -> int:
    match = _SPACE.match(text, pos)
    return match.end() if match else pos


def _object_spans(text: str, pos: int) -> tuple[dict[str, tuple[int, int]], int]:
    """The JSON object at pos: {key: (value start, value end)} and the index after it."""
    if text[pos] != "{":
        raise ValueError("not an object")
    members: dict[str, tuple[int, int]] = {}
    pos = _skip(text, pos + 1)
    if text[pos] == "}":
        return members, pos + 1
    while True:
        if text[pos] != '"':
            raise ValueError("expected a key")
        key, pos = _DECODER.raw_decode(text, pos)  # the key string, quotes included
        pos = _skip(text, pos)
        if text[pos] != ":":
            raise ValueError("expected ':'")
        value_start = _skip(text, pos + 1)
        _, value_end = _DECODER.raw_decode(text, value_start)
        members[key] = (value_start, value_end)
        pos = _skip(text, value_end)
        if text[pos] == "}":
            return members, pos + 1
        if text[pos] != ",":
            raise ValueError("expected ',' or '}'")
        pos = _skip(text, pos + 1)


def _array_item_starts(text: str, pos: int) -> list[int]:
    if text[pos] != "[":
        raise ValueError("not an array")
    starts: list[int] = []
    pos = _skip(text, pos + 1)
    if text[pos] == "]":
        return starts
    while True:
        starts.append(pos)
        _, end = _DECODER.raw_decode(text, pos)
        pos = _skip(text, end)
        if text[pos] == "]":
            return starts
        if text[pos] != ",":
            raise ValueError("expected ',' or ']'")
        pos = _skip(text, pos + 1)
