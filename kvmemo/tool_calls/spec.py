"""Tools and tool choices as OpenAI's chat API defines them, validated (InputError names the
field), and the calls a reply makes.

Invariant: a ToolSpec's name is unique among the request's tools and its parameters are a JSON
schema object; a ToolChoice names only a tool the request defines.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmemo.errors import InputError

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names
_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})

    def as_openai(self) -> dict[str, Any]:
        """{"type": "function", "function": {...}}: what templates that take tools expect."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, for "named"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def parse_tools(tools: Sequence[Any] | None) -> list[ToolSpec]:
    """OpenAI's `tools` list -> ToolSpecs; InputError("tools") for anything malformed."""
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InputError("tools", f"{where}: only {{'type': 'function', ...}} tools exist")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InputError("tools", f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InputError(
                "tools", f"{where}.function.name must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}"
            )
        if any(s.name == name for s in specs):
            raise InputError("tools", f"{where}: a second tool named {name!r}")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        _check_schema(parameters, f"{where}.function.parameters")
        if parameters.get("type", "object") != "object":
            raise InputError("tools", f"{where}.function.parameters must describe an object")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise InputError("tools", f"{where}.function.description must be a string")
        specs.append(ToolSpec(name, description, parameters))
    return specs


def parse_tool_choice(choice: Any, tools: Sequence[ToolSpec]) -> ToolChoice:
    """OpenAI's `tool_choice` (default: "auto" with tools, "none" without)."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InputError(
                "tool_choice",
                f"tool_choice must be none, auto, required or a named function, got {choice!r}",
            )
        if choice != "none" and not tools:
            raise InputError("tool_choice", f"tool_choice {choice!r} needs tools")
        return ToolChoice(choice)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InputError(
            "tool_choice",
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
        )
    if not any(t.name == name for t in tools):
        known = ", ".join(t.name for t in tools) or "none"
        raise InputError("tool_choice", f"tool_choice names {name!r}, not a tool (tools: {known})")
    return ToolChoice("named", name)


def _check_schema(schema: Any, where: str) -> None:
    """A light JSON-schema shape check (types are known names, properties are schemas), so a
    bad schema is a 400 here rather than a grammar error or a silently free argument."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InputError("tools", f"{where} must be a JSON schema object")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in _SCHEMA_TYPES:
            raise InputError("tools", f"{where}.type {k!r} is not a JSON schema type")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise InputError("tools", f"{where}.properties must be an object")
    for key, sub in properties.items():
        _check_schema(sub, f"{where}.properties.{key}")
    if "items" in schema:
        _check_schema(schema["items"], f"{where}.items")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InputError("tools", f"{where}.required must be a list of property names")
