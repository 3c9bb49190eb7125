"""OpenAI tool calling on any model: tool specs and choices (spec.py), the conversation as the
chat template sees it (render.py), and the model's reply back into calls (parse.py).

A model whose chat template takes `tools` gets them through it and answers in its own format
(Hermes-style <tool_call> tags are parsed); any other model gets the fallback: the tool schemas
in the system turn and a JSON call format, which `required` and named tool choices enforce with
structured output.
"""

from kvmemo.tool_calls.parse import ParsedReply, parse_reply
from kvmemo.tool_calls.render import ToolPrompt, prepare_tool_prompt, tools_for_request
from kvmemo.tool_calls.spec import ToolCall, ToolChoice, ToolSpec, parse_tool_choice, parse_tools

__all__ = [
    "ParsedReply", "ToolCall", "ToolChoice", "ToolPrompt", "ToolSpec", "parse_reply",
    "parse_tool_choice", "parse_tools", "prepare_tool_prompt", "tools_for_request",
]
