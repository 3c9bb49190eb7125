"""ChatOptions: how a conversation is rendered by its chat template (vLLM's request options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmemo.errors import InputError


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered (vLLM's chat request options, the same names)."""

    add_generation_prompt: bool = True  # end with the assistant's header: the model answers
    # End inside the last (assistant) message instead, so the model continues it.
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes its own; True adds a BOS on top
    template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    chat_template: str | None = None  # a Jinja template for this request (the model's if None)
    # OpenAI-form tools for a template that takes them (kvmemo.tool_calls decides; the fallback
    # renders tools into the messages instead)
    tools: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise InputError(
                "continue_final_message",
                "continue_final_message needs add_generation_prompt: false (it continues the "
                "last message instead of starting a new one)",
            )
