"""OpenAI Responses API requests (POST /v1/responses) and their translation into the chat route's
request.

Invariant: a Responses request becomes exactly one ChatCompletionRequest: `instructions` as the
system message, then the stored conversation of `previous_response_id` (its input and output,
without its instructions, as OpenAI does), then the `input` items in order (messages with
input_text/output_text/input_image parts, function_call items as the assistant's tool_calls,
function_call_output items as tool messages); function tools, tool_choice and text.format
(json_schema, json_object) in the chat route's shapes. Fields that do not change a reply here are
accepted and not used; anything else is a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvmemo.errors import InputError
from kvmemo.kv.retention import Retention
from kvmemo.server.protocol import ChatCompletionRequest


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    # kvmemo's own: the tenant's prefix-cache isolation (stored responses are scoped by it too)
    cache_salt: str | None = Field(default=None, min_length=1)
    # Accepted and not used: they do not change a reply here (every full block is cached
    # anyway; the bundled models do not reason).
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None  # "in_memory" (the default) or "24h"
    prompt_cache_options: dict[str, Any] | None = None  # {"ttl": "30m" | "12h", "mode": ...}
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None


WHOLE_PROMPT = 1 << 40  # a Retention's num_tokens for every prompt token (clamped to them)
RETENTION_SECONDS = {"24h": 86400.0}  # prompt_cache_retention; "in_memory" retains nothing
TTL_SECONDS = {"30m": 1800.0, "12h": 43200.0}  # prompt_cache_options.ttl


def retention(body: ResponsesRequest) -> tuple[Retention, ...]:
    """The whole prompt retained for prompt_cache_retention "24h" and for prompt_cache_options'
    ttl (its implicit breakpoint: the whole prompt; mode "explicit" with no breakpoint, which
    kvmemo does not take on content, caches nothing extra). 400s name the field."""
    ranges: list[Retention] = []
    policy = body.prompt_cache_retention
    if policy not in (None, "in_memory", *RETENTION_SECONDS):
        raise InputError("prompt_cache_retention", "prompt_cache_retention must be "
                         f"'in_memory' or '24h', got {policy!r}")
    if policy in RETENTION_SECONDS:
        ranges.append(Retention(WHOLE_PROMPT, RETENTION_SECONDS[policy]))
    options = body.prompt_cache_options or {}
    unknown = sorted(set(options) - {"ttl", "mode", "prewarm", "comparison_response_id"})
    if unknown:
        raise InputError("prompt_cache_options", "prompt_cache_options takes ttl, mode, prewarm "
                         f"and comparison_response_id; got {unknown}")
    mode, ttl = options.get("mode", "implicit"), options.get("ttl", "30m")
    if mode not in ("implicit", "explicit"):
        raise InputError("prompt_cache_options.mode", "prompt_cache_options.mode must be "
                         f"'implicit' or 'explicit', got {mode!r}")
    if ttl not in TTL_SECONDS:
        raise InputError("prompt_cache_options.ttl", "prompt_cache_options.ttl must be "
                         f"'30m' or '12h', got {ttl!r}")
    if options and mode == "implicit":
        ranges.append(Retention(WHOLE_PROMPT, TTL_SECONDS[ttl]))
    return tuple(ranges)


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat route's request: instructions, then `history` (a stored conversation's chat
    messages), then the input items."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    messages += history + input_messages(body.input)
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "stream": body.stream,
        "max_tokens": body.max_output_tokens, "top_p": body.top_p,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "cache_salt": body.cache_salt,
    }
    if body.tools:
        fields["tools"] = [_function_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    format_ = (body.text or {}).get("format")
    if format_ is not None:
        fields["response_format"] = _response_format(format_)
    return ChatCompletionRequest.model_validate(fields)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages (consecutive function_call items: one assistant message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(i, item))
        elif kind == "function_call":
            call = {"id": _field(i, item, "call_id"), "type": "function", "function": {
                "name": _field(i, item, "name"), "arguments": _field(i, item, "arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _parts_text(i, output)
            messages.append({"role": "tool", "tool_call_id": _field(i, item, "call_id"),
                             "content": output})
        elif kind == "reasoning":
            continue  # the bundled models do not reason: nothing to give back
        else:
            raise InputError("input", f"input[{i}]: items are messages, function_call and "
                                      f"function_call_output, not {kind!r}")
    return messages


def _message(index: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InputError("input", f"input[{index}].role must be user, assistant, system or "
                                  f"developer, got {role!r}")
    content = item.get("content")
    if not isinstance(content, str):
        parts = _parts(index, content)
        content = parts if any(p["type"] != "text" for p in parts) else "".join(
            p["text"] for p in parts)
    return {"role": "system" if role == "developer" else role, "content": content}


def _parts(index: int, content: Any) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise InputError("input", f"input[{index}].content must be a string or a list of parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise InputError("input", f"input[{index}].content[{j}]: parts are input_text, "
                                      f"output_text and input_image (a data: URL), got {kind!r}")
    return parts


def _parts_text(index: int, content: Any) -> str:
    return "".join(p["text"] for p in _parts(index, content) if p["type"] == "text")


def _field(index: int, item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InputError("input", f"input[{index}].{name} must be a string")
    return value


def _function_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise InputError("tools", f"tools[{index}]: only function tools (type 'function' with "
                                  f"a name) are served, got {tool.get('type')!r}")
    return {"type": "function", "function": {
        "name": tool["name"], "description": tool.get("description") or "",
        "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # auto, none, required: the chat route checks the value
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InputError("tool_choice", "tool_choice is auto, none, required or "
                                    "{\"type\": \"function\", \"name\": ...}")


def _response_format(format_: dict[str, Any]) -> dict[str, Any]:
    kind = format_.get("type")
    if kind == "text":
        return {"type": "text"}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(format_.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {
            "name": format_.get("name") or "output", "schema": format_["schema"],
            "strict": format_.get("strict")}}
    raise InputError("text.format", "text.format is {\"type\": \"text\"}, {\"type\": "
                                    "\"json_object\"} or a json_schema with a schema")
