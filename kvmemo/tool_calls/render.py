"""A conversation with tools, as the chat template will see it, and the constraint on the reply.

The fallback (for templates that do not take `tools`, such as SmolLM2's and Gemma 3's) is
documented in docs/server.md: a "# Tools" block at the end of the system turn lists each
function's JSON schema and asks for `{"tool_calls": [{"name": ..., "arguments": {...}}]}` as
the whole reply; earlier calls are rendered back in exactly that form (arguments verbatim, as
the model wrote them) and tool results become user turns, so turn N+1's prompt starts with turn
N's prompt and reply: an agent loop re-reads everything before it from the prefix cache.

Invariant: rendering is a pure function of (messages, tools): the same history renders to the
same text on every turn, through the offline API and the server alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from kvmemo.errors import InputError
from kvmemo.structured.params import StructuredOutputsParams
from kvmemo.tool_calls.spec import ToolChoice, ToolSpec, parse_tool_choice, parse_tools

FALLBACK = "json"  # the reply format of the fallback template
HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": ...}</tool_call>, for tool templates

_INSTRUCTIONS = (
    "# Tools\n\n"
    "You can call these functions. To call one or more of them, reply with only this JSON "
    "and nothing else:\n"
    '{"tool_calls": [{"name": "<function name>", "arguments": {<arguments>}}]}\n'
    "To answer without calling a function, reply in plain text.\n\n"
    "Functions:\n"
)


@dataclass(frozen=True)
class ToolPrompt:
    messages: list[dict[str, Any]]  # for the chat template
    template_tools: list[dict[str, Any]] | None  # apply_chat_template(tools=...), if it takes them
    constraint: StructuredOutputsParams | None  # for required / named choices
    reply_format: str  # FALLBACK or HERMES: how parse_reply reads the answer
    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = ToolChoice("none")

    @property
    def parses_calls(self) -> bool:
        """Whether the reply is read for calls (not for tool_choice none)."""
        return self.choice.mode != "none" and bool(self.tools)


def tools_for_request(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[Any] | None,
    tool_choice: Any = None,
    *,
    parallel_tool_calls: bool = True,
    template: str | None = None,
) -> ToolPrompt | None:
    """One chat request's tools in OpenAI's form (the server's and LLM.chat's one path):
    None when it has neither tools nor tool turns in its history; InputError names a bad
    field."""
    history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not tools and not history:
        if tool_choice not in (None, "none"):
            raise InputError("tool_choice", "tool_choice needs tools")
        return None
    specs = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, specs)
    return prepare_tool_prompt(
        messages, specs, choice, parallel_tool_calls=parallel_tool_calls,
        template_has_tools=template_takes_tools(template),
    )


def template_takes_tools(template: str | None) -> bool:
    """Whether a Jinja chat template reads a `tools` variable (HF's convention)."""
    if not template:
        return False
    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return False  # rendering will report it
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def prepare_tool_prompt(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[ToolSpec],
    choice: ToolChoice,
    *,
    parallel_tool_calls: bool = True,
    template_has_tools: bool = False,
) -> ToolPrompt:
    """messages: normalised OpenAI messages (role, content, tool_calls, tool_call_id)."""
    names = _check_history(messages)
    constraint = _constraint(tools, choice, parallel_tool_calls)
    if template_has_tools:
        return ToolPrompt(
            [_for_tool_template(m) for m in messages],
            [t.as_openai() for t in tools] if tools else None,
            constraint,
            FALLBACK if constraint is not None else HERMES,
            tuple(tools),
            choice,
        )
    rendered = [_for_fallback(m, names) for m in messages]
    if tools:
        block = _INSTRUCTIONS + "\n".join(
            json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                       ensure_ascii=False)
            for t in tools
        )
        if rendered and rendered[0]["role"] == "system":
            first = rendered[0]
            rendered[0] = {**first, "content": f"{first['content']}\n\n{block}".lstrip()}
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return ToolPrompt(rendered, None, constraint, FALLBACK, tuple(tools), choice)


def calls_as_json(calls: Sequence[dict[str, Any]]) -> str:
    """The fallback's text for OpenAI tool_calls; arguments (JSON text) are kept verbatim."""
    parts = []
    for call in calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
        parts.append(f'{{"name": {json.dumps(function.get("name"), ensure_ascii=False)}, '
                     f'"arguments": {arguments}}}')
    return '{"tool_calls": [' + ", ".join(parts) + "]}"


def _check_history(messages: Sequence[dict[str, Any]]) -> dict[str, str]:
    """call id -> function name for every call the history makes; a tool message must answer
    one of them, and an assistant call must carry a function name and JSON arguments."""
    names: dict[str, str] = {}
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InputError(
                    "messages", f"messages[{i}].tool_calls[{j}] needs function.name"
                )
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    json.loads(arguments)
                except ValueError:
                    raise InputError(
                        "messages",
                        f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                    ) from None
            names[str(call.get("id"))] = function["name"]
        if message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in names:
                raise InputError(
                    "messages",
                    f"messages[{i}].tool_call_id {call_id!r} answers no earlier tool call",
                )
    return names


def _for_fallback(message: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    role, content = message["role"], message.get("content") or ""
    if role == "assistant" and message.get("tool_calls"):
        calls = calls_as_json(message["tool_calls"])
        return {"role": "assistant", "content": f"{content}\n{calls}" if content else calls}
    if role == "tool":
        call_id = message["tool_call_id"]
        return {"role": "user",
                "content": f"Result of {names[call_id]} (call {call_id}):\n{content}"}
    return {"role": role, "content": content}


def _for_tool_template(message: dict[str, Any]) -> dict[str, Any]:
    """HF's message convention for templates that take tools: arguments as objects."""
    out = {k: v for k, v in message.items() if v is not None}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"type": "function", "id": call.get("id"), "function": {
                "name": call["function"]["name"],
                "arguments": _as_object(call["function"].get("arguments")),
            }}
            for call in message["tool_calls"]
        ]
    return out


def _as_object(arguments: Any) -> Any:
    return json.loads(arguments) if isinstance(arguments, str) else (arguments or {})


def _constraint(
    tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool
) -> StructuredOutputsParams | None:
    """The fallback's reply schema, for a choice that must call: `required` (any tool) or a
    named function; None for auto and none (the model decides)."""
    if choice.mode not in ("required", "named"):
        return None
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    items = [
        {"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
         "required": ["name", "arguments"]}
        for t in chosen
    ]
    array: dict[str, Any] = {
        "type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    if not parallel or choice.mode == "named":
        array["maxItems"] = 1
    return StructuredOutputsParams(json={
        "type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
    })
