"""Tools into a chat prompt: where a request's tools, tool choice and tool-call history become the
messages and template options its chat template renders, and the one rule for a tool choice that
constrains the reply.

Invariant: LLM.chat, the server's chat route, /tokenize and the router's prompt hasher all render
a request's tools here, with the chat template the request renders with, so the four see the
same prompt tokens (the router predicts the replica's block hashes for tool requests too), and a
`required` or named tool choice beside another structured-output constraint is refused alike
everywhere, never silently replaced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvmemo.errors import InputError
from kvmemo.intake.chat_options import ChatOptions
from kvmemo.sampling import SamplingParams
from kvmemo.tool_calls.render import ToolPrompt, tools_for_request


@dataclasses.dataclass(frozen=True)
class ChatTools:
    """What a chat request says about tools (OpenAI's fields)."""

    tools: Sequence[Any] | None = None
    tool_choice: Any = None  # "auto", "none", "required" or {"type": "function", ...}
    parallel_tool_calls: bool = True


@dataclasses.dataclass(frozen=True)
class ToolRendering:
    """A chat request's messages and options with its tools rendered in, and the ToolPrompt that
    parses the reply (None without tools or tool history)."""

    messages: list[dict[str, Any]]
    options: ChatOptions
    prompt: ToolPrompt | None


def render_tools(
    messages: list[dict[str, Any]], options: ChatOptions | None, tools: ChatTools,
    template: str | None,
) -> ToolRendering:
    """Tools and tool history rendered for `template` (the one the request renders with: its
    options' chat_template, else the model's); unchanged without either. InputError names a bad
    field."""
    options = options or ChatOptions()
    prompt = tools_for_request(
        messages, tools.tools, tools.tool_choice,
        parallel_tool_calls=tools.parallel_tool_calls, template=template,
    )
    if prompt is None:
        return ToolRendering(messages, options, None)
    return ToolRendering(prompt.messages, dataclasses.replace(options, tools=prompt.template_tools),
                         prompt)


def constrain_reply(params: SamplingParams, prompt: ToolPrompt | None) -> SamplingParams:
    """params with a `required` or named tool choice's constraint on the reply; InputError when
    the request constrains its reply otherwise too."""
    if prompt is None or prompt.constraint is None:
        return params
    if params.structured_outputs is not None:
        raise InputError(
            "tool_choice",
            f"tool_choice {prompt.choice.mode!r} constrains the reply itself; drop "
            "response_format / structured outputs or use tool_choice auto",
        )
    return dataclasses.replace(params, structured_outputs=prompt.constraint)
