"""InputProcessor: user prompts and chat messages -> validated prompt token ids.

Invariant: every token id it returns is in [0, vocab_size); bad input raises ValueError naming
what was wrong and what is allowed.
"""

from __future__ import annotations

from typing import Any

_ROLES = ("system", "user", "assistant", "tool")


class InputProcessor:
    """Owns the tokenizer and the chat template."""

    def __init__(self, tokenizer: Any, vocab_size: int, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.chat_template = chat_template

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
            return list(self.tokenizer(prompt)["input_ids"])
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}")
        return list(prompt)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        validate_messages(messages)
        kwargs = {"chat_template": self.chat_template} if self.chat_template else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        text = self.render_chat(messages)
        # The template already wrote the special tokens; do not add a BOS on top.
        return text, list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(_ROLES)}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(m['content']).__name__}")
