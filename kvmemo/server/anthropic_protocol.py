"""Anthropic Messages API requests (POST /v1/messages, /v1/messages/count_tokens) and their
translation into the chat route's request, which the one intake path then renders.

Invariant: a Messages request becomes exactly one ChatCompletionRequest (system blocks joined
into the system message, tool_use blocks into the assistant's tool_calls, tool_result blocks
into tool messages in their order, base64 images into data: URLs, tools and tool_choice into
OpenAI's shapes), so both routes render, cache and route a conversation alike; every field the
API defines is either translated or refused with a 400 naming it; the fields that do not change
a reply here are accepted and not used (metadata, service_tier, speed, inference_geo,
diagnostics, user_profile_id, workspace_id, output_config.effort, and thinking: the bundled
models have no reasoning mode). cache_control breakpoints (per block, or top-level: the last
block) are validated and counted (CacheBreakpoints), not rendered: kvmemo caches every full
block of every prompt anyway. temperature, top_p and top_k, which the 2026 API dropped, are
still taken (older clients send them, newer ones through extra_body).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvmemo.errors import InputError
from kvmemo.server.protocol import ChatCompletionRequest

TTLS = ("5m", "1h")  # the retention times Anthropic's cache_control allows
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"] = "ephemeral"
    ttl: str = "5m"


class _Block(BaseModel):
    # Blocks a client sends back as it received them carry response-only fields (citations,
    # caller): ignored.
    model_config = ConfigDict(extra="ignore")
    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock,
                  Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(BaseModel):
    """The fields that make a prompt (POST /v1/messages/count_tokens takes only these)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    cache_control: CacheControl | None = None  # top-level: a breakpoint at the last block
    system: str | list[TextBlock] | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class JSONOutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    # (Anthropic's field name; "schema" shadows a BaseModel attribute, hence the alias)
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # not used
    format: JSONOutputFormat | None = None  # through the structured-output path


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    output_config: OutputConfig | None = None
    # Accepted and not used: they do not change a reply here.
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # kvmemo's own: the tenant's prefix-cache isolation, as on the OpenAI routes
    cache_salt: str | None = Field(default=None, min_length=1)


@dataclass(frozen=True)
class CacheBreakpoints:
    """The request's cache_control marks: how many, the longest ttl asked for, and what each
    caches: the request cut just after its marked block (None: the whole request), with its
    ttl. Anthropic's prefix order is tools, system, messages; a chat template renders the tools
    in the system turn, so a mark on a tool keeps the system prompt too."""

    count: int
    ttl: str | None
    prefixes: tuple[tuple[CountTokensRequest | None, str], ...] = ()


def breakpoints(body: CountTokensRequest) -> CacheBreakpoints:
    """Every cache_control mark of the request, its ttl checked (400 naming the field)."""
    marks: list[tuple[str, CacheControl, CountTokensRequest | None]] = []
    if body.cache_control is not None:  # automatic caching: the whole request
        marks.append(("cache_control", body.cache_control, None))
    if isinstance(body.system, list):
        marks += [(f"system[{i}]", b.cache_control,
                   body.model_copy(update={"system": body.system[: i + 1], "messages": []}))
                  for i, b in enumerate(body.system) if b.cache_control]
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list):
            marks += [(f"messages[{i}].content[{j}]", b.cache_control, body.model_copy(update={
                "messages": [*body.messages[:i],
                             message.model_copy(update={"content": message.content[: j + 1]})]}))
                      for j, b in enumerate(message.content) if b.cache_control]
    marks += [(f"tools[{i}]", t.cache_control,
               body.model_copy(update={"tools": (body.tools or [])[: i + 1], "messages": []}))
              for i, t in enumerate(body.tools or []) if t.cache_control]
    for where, mark, _ in marks:
        if mark.ttl not in TTLS:
            raise InputError(f"{where}.cache_control.ttl",
                             f"{where}.cache_control.ttl must be one of {list(TTLS)}, "
                             f"got {mark.ttl!r}")
    if len(marks) > 4:  # Anthropic's limit
        raise InputError("cache_control", f"at most 4 cache_control breakpoints, got {len(marks)}")
    longest = max((m.ttl for _, m, _ in marks), key=TTLS.index, default=None)
    return CacheBreakpoints(len(marks), longest, tuple((cut, m.ttl) for _, m, cut in marks))


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat route's request for this Messages request (sampling fields too, if it has them)."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(
            block.text for block in body.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        messages += _openai_messages(i, message)
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in body.tools]
    if body.tool_choice is not None:
        fields.update(_tool_choice(body.tool_choice, bool(body.tools)))
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stream=body.stream, top_k=body.top_k,
                      stop=body.stop_sequences, cache_salt=body.cache_salt,
                      temperature=1.0 if body.temperature is None else body.temperature,
                      top_p=body.top_p)
        output = body.output_config
        if output is not None and output.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": output.format.json_schema}}
    return ChatCompletionRequest.model_validate(fields)


def _openai_messages(index: int, message: Message) -> list[dict[str, Any]]:
    """One Messages-API message as chat messages: an assistant's text and tool calls in one; a
    user's tool results as tool messages (first, in order), then its text and images."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    where = f"messages[{index}].content"
    if message.role == "assistant":
        text, calls = [], []
        for j, block in enumerate(message.content):
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input)}})
            else:
                raise InputError("messages", f"{where}[{j}]: an assistant message holds text "
                                             f"and tool_use blocks, not {block.type}")
        out: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            out["tool_calls"] = calls
        return [out]
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, ToolResultBlock):
            result = block.content if isinstance(block.content, str) else "\n".join(
                part.text for part in block.content)
            if block.is_error:
                result = f"Error: {result}"
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": result})
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            url = f"data:{block.source.media_type};base64,{block.source.data}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise InputError("messages", f"{where}[{j}]: a user message holds text, image and "
                                         f"tool_result blocks, not {block.type}")
    if parts:
        text_only = all(p["type"] == "text" for p in parts)
        content: Any = "".join(p["text"] for p in parts) if text_only else parts
        results.append({"role": "user", "content": content})
    return results


def _tool_choice(choice: ToolChoice, has_tools: bool) -> dict[str, Any]:
    if choice.type != "none" and not has_tools:
        raise InputError("tool_choice", f"tool_choice {choice.type!r} needs tools")
    fields: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        if not choice.name:
            raise InputError("tool_choice.name", "tool_choice of type 'tool' names the tool")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields
