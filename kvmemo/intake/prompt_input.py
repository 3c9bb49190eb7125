"""PromptInput: one request's input in any of its forms, with the options that shape its tokens.

Every caller (LLM, AsyncEngine and so the server, /tokenize, the router's prompt hasher) hands
one to InputProcessor.process, the intake's one front door, which turns it into a
ProcessedPrompt. Exactly one form: a prompt (text or token ids, with images for a multimodal
model), a chat (messages, with template options and documents), or segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmemo.errors import InputError
from kvmemo.intake.chat_options import ChatOptions


@dataclass(frozen=True)
class PromptInput:
    """Raises InputError unless exactly one of prompt, messages and segments is given."""

    prompt: str | list[int] | None = None  # text or token ids
    messages: list[dict[str, Any]] | None = None  # a chat, OpenAI message forms
    segments: list[Any] | None = None  # a segmented prompt (chunk KV reuse, segments.py)
    images: list[Any] | None = None  # for a prompt: the images its markers stand for
    chat_options: ChatOptions | None = None  # for messages: the template's options and tools
    documents: Sequence[Any] | None = None  # for messages: texts placed as segments
    add_special_tokens: bool = True  # for a text prompt: the tokenizer's own (a BOS)
    truncate_prompt_tokens: int | None = None  # keep the last that many tokens
    kv_reuse: str | None = None  # "prefix" or "blend" (segments, documents, separators)
    recompute_ratio: float | None = None  # blend: the share of reused tokens recomputed

    def __post_init__(self) -> None:
        given = [name for name in ("prompt", "messages", "segments")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise InputError("prompt", "give exactly one of prompt, messages and segments; "
                                       f"got {given or 'none'}")

    @classmethod
    def from_offline(cls, prompt: Any) -> PromptInput:
        """A prompt in a form the offline API (LLM.generate) takes: a string, token ids,
        (multimodal models) {"prompt": "USER: <image>\\nWhat is this?", "images": [...]}, or
        {"segments": [context, chunk, ..., question], "kv_reuse": "blend",
        "recompute_ratio": 0.15} (the last two optional; see segments.py), or vLLM's token
        form {"prompt_token_ids": [...]}."""
        if not isinstance(prompt, dict):
            return cls(prompt=prompt)
        if "prompt_token_ids" in prompt:
            if set(prompt) != {"prompt_token_ids"}:
                raise InputError(
                    "prompt",
                    "a token prompt takes the one key 'prompt_token_ids'; "
                    f"got {sorted(prompt)}",
                )
            return cls(prompt=prompt["prompt_token_ids"])
        if "segments" in prompt:
            unknown = sorted(set(prompt) - {"segments", "kv_reuse", "recompute_ratio"})
            if unknown:
                raise InputError(
                    "prompt",
                    "a segments prompt takes the keys 'segments' (required), 'kv_reuse' and "
                    f"'recompute_ratio'; got {sorted(prompt)}",
                )
            return cls(segments=prompt["segments"], kv_reuse=prompt.get("kv_reuse"),
                       recompute_ratio=prompt.get("recompute_ratio"))
        unknown = sorted(set(prompt) - {"prompt", "images"})
        if unknown or "prompt" not in prompt:
            raise InputError(
                "prompt",
                "a dict prompt takes the keys 'prompt' (required) and 'images', or "
                f"'prompt_token_ids', or 'segments'; got {sorted(prompt)}",
            )
        images = prompt.get("images") or []
        if not isinstance(images, (list, tuple)):
            images = [images]
        return cls(prompt=prompt["prompt"], images=list(images))
