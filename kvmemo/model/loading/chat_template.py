"""Chat templates rendered as Hugging Face's tokenizers render them, without importing transformers.

`transformers` costs a second of start-up to import (it indexes its hundreds of models), and the
engine needs nothing of it but this rendering, so kvmemo renders templates itself. The contract,
checked against `apply_chat_template` itself (tests/model/test_fast_tokenizer.py): the same
sandbox (trim_blocks, lstrip_blocks, loop controls, `{% generation %}` blocks), the same globals
(raise_exception, strftime_now, a restricted dict() and namespace()), the same tojson (no HTML
escaping), the tokenizer's special tokens as variables under the caller's, messages without
their None-valued keys, reasoning under all its names, and continue_final_message's cut.

Invariant: the caller's messages, tools and kwargs are never mutated (the template sees copies
made of plain JSON types; anything else becomes a placeholder naming its type).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning goes by; templates read one or another.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the text to continue, found again in the output, and cut there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks an assistant reply for training masks;
    rendering keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore-prefixed names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed names on a namespace: {name!r}"
            )


class _TemplateDict:
    """dict() for templates: builds plain dicts, exposes nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which no chat template wants.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compiled(template: str) -> jinja2.Template:
    """The compiled template (templates are few and long-lived: compile each once)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env.from_string(template)


def plain(value: Any) -> Any:
    """A copy of `value` made of JSON's types (str, int, float, bool, None, dict, list, tuple);
    anything else becomes "<TypeName>", which templates only test for presence."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):  # subclasses (enums, IntFlags) lose their methods
        if isinstance(value, kind):
            return kind(value)
    if type(value).__module__ == "numpy" and type(value).__name__ != "ndarray":
        return plain(value.item())  # a NumPy scalar: np.bool_(False) must stay falsy
    if isinstance(value, Mapping):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models (the OpenAI SDK's)
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Plain copies of the messages, None-valued keys dropped (templates handle a missing key,
    many print None), reasoning present under every name templates read."""
    out = []
    for message in messages:
        message = plain(message)
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None),
                         None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(template: str, chat: list[dict[str, Any]], field: str) -> str:
    """Appends the continue tag to the final message's text; returns that text (untagged)."""
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message: the final message has no "{field}"')
    fields = [field]
    if field in REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
        fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(
            f'continue_final_message is set to "{field}" but the chat template never reads it'
        )
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return str(text)
        raise ValueError("continue_final_message: the final message has no text to continue")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return str(final)


def choose_template(template: str | Mapping[str, str] | None, has_tools: bool) -> str:
    """The template to render: a checkpoint may ship several named ones ("tool_use" for a
    request with tools when there is one, else "default"), or none (ValueError)."""
    if not template:
        raise ValueError("this model has no chat template: send a prompt, or give chat_template")
    if isinstance(template, str):
        return template
    name = "tool_use" if has_tools and "tool_use" in template else "default"
    if name not in template:
        raise ValueError(f"the checkpoint's chat templates are named {sorted(template)}; "
                         "none is \"default\": give chat_template")
    return template[name]


def render_chat_template(
    template: str,
    messages: list[Any],
    *,
    special_tokens: Mapping[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **kwargs: Any,
) -> str:
    """The text `template` renders for one conversation. special_tokens (bos_token, eos_token,
    ...) are visible to the template unless kwargs name them too. Raises ValueError or
    jinja2.TemplateError when the template or the arguments refuse."""
    if not messages:
        raise ValueError("a chat needs at least one message")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    for tool in tools or ():
        if not isinstance(tool, dict):
            raise ValueError(f"tools must be JSON schemas (dicts), got {type(tool).__name__}")
    for document in documents or ():
        if not isinstance(document, dict):
            raise TypeError("documents must be dicts with 'title' and 'text' keys")
    chat = _template_messages(messages)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final_message(template, chat, field)
    text: str = compiled(template).render(
        messages=chat, tools=plain(tools), documents=plain(documents),
        add_generation_prompt=add_generation_prompt,
        **{**dict(special_tokens or {}), **plain(kwargs)},
    )
    if final is None:
        return text
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message: the chat template dropped part of the final "
                         "message, so there is nothing to continue")
    at = text.rindex(tag)
    # Where the template trimmed the message's trailing space, trim what is left as well.
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
