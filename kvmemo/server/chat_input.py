"""A chat request body as the intake takes it: its messages as the chat template reads them, its
template options and its tools.

Invariant: the chat route and the router's prompt hasher read a body through these functions
alone, so both hand the intake the same input (no engine import here: the router loads only the
tokenizer).
"""

from __future__ import annotations

from typing import Any

from kvmemo.errors import InputError
from kvmemo.intake.chat_options import ChatOptions
from kvmemo.intake.tools import ChatTools
from kvmemo.server.protocol import ChatCompletionRequest, ChatMessage, ImagePart, TextPart


def engine_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the engine's chat template takes them."""
    return [engine_message(i, message) for i, message in enumerate(body.messages)]


def chat_options(body: ChatCompletionRequest) -> ChatOptions:
    """The request's chat template options (the route's and the router's hasher's one reading)."""
    return ChatOptions(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens,
        template_kwargs=body.chat_template_kwargs,
        chat_template=body.chat_template,
    )


def chat_tools(body: ChatCompletionRequest) -> ChatTools:
    return ChatTools(body.tools, body.tool_choice,
                     parallel_tool_calls=body.parallel_tool_calls is not False)


def engine_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A ChatMessage as the engine's chat template takes it."""
    content: str | list[dict[str, Any]] | None
    if not isinstance(message.content, list):
        content = message.content
    elif any(isinstance(part, ImagePart) for part in message.content):
        # The processor loads the images (data: URLs only) and places them; a text-only model
        # or a bad image is an InputError, so a 400.
        content = [part.model_dump() for part in message.content]
        if any(part["type"] == "image" for part in content):
            raise InputError(
                "messages",
                f"messages[{index}].content: send images as image_url parts with a data: URL",
            )
    else:
        content = "\n".join(part.text for part in message.content if isinstance(part, TextPart))
    # The template knows system, not OpenAI's newer "developer" name for it.
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out
