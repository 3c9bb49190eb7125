"""InputProcessor: the one intake step, prompts, chats and images -> ProcessedPrompts (validated
token ids, images placed and hashed), for LLM, the server, the CLI and the router's hasher alike.

Invariant: every token id it returns is in [0, vocab_size); each image becomes the model's
number of placeholder tokens where its marker stood, a MultiModalItem hashed after preprocessing;
bad input raises ValueError naming what was wrong and what is allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import jinja2

from kvmemo.errors import InputError
from kvmemo.intake.chat_options import ChatOptions
from kvmemo.intake.prompt_input import PromptInput
from kvmemo.intake.reply_tokens import ReplyTokenCache
from kvmemo.intake.segments import (
    SegmentPlan,
    check_documents,
    encode_segments,
    messages_with_documents_marker,
    split_at_documents_marker,
    split_at_separator,
)
from kvmemo.kv.mm_items import MultiModalItem
from kvmemo.model.loading.chat_template import choose_template, render_chat_template

_ROLES = ("system", "user", "assistant", "tool")
_IMAGE_PART_TYPES = ("image_url", "input_image", "image")
# OpenAI's newer name for the system role; chat templates know only "system".
_ROLE_ALIASES = {"developer": "system"}
_PROMPT_FORMS = "prompt must be a non-empty string or a non-empty list of token ids"


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt ready for the engine: token ids with image placeholders expanded."""

    token_ids: list[int]
    text: str | None = None  # the prompt as text, when there was one (for RequestOutput.prompt)
    mm_items: list[MultiModalItem] = field(default_factory=list)  # sorted by offset
    mm_data: list[Any] = field(default_factory=list)  # pixel arrays [3, S, S], parallel to mm_items
    # A prompt given as segments (context, chunks, question): where each starts, and how it
    # reuses KV (kvmemo/intake/segments.py); None for a plain prompt.
    segments: SegmentPlan | None = None


class InputProcessor:
    """Owns the tokenizer, the chat template and (for multimodal models) the image spec."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        chat_template: str | None = None,
        image_input: Any | None = None,  # an ImageInputSpec for models that take images
        blend_separator: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # The ids of replies this engine generated, so a conversation that sends one back
        # renders it with them (prefix-stable turns; see reply_tokens.py).
        self.reply_tokens = ReplyTokenCache()
        self.chat_template = chat_template
        self.image_input = image_input
        # LMCache's convention: a text prompt holding this string is split at it into
        # segments (the separator removed); None: prompts are never split.
        self.blend_separator = blend_separator

    def process(
        self,
        inputs: PromptInput | str | list[int],
        cache_salt: str | None = None,
        *,
        token_ids: list[int] | None = None,
    ) -> ProcessedPrompt:
        """The intake's front door: LLM, AsyncEngine (and so the server), /tokenize and the
        router's prompt hasher all turn their input into tokens here. A bare text or token-id
        list is PromptInput(prompt=...). cache_salt: a chat's (reply tokens are remembered per
        salt). token_ids: a text prompt's encoding by encode_texts, when a caller batched it."""
        if not isinstance(inputs, PromptInput):
            inputs = PromptInput(prompt=inputs)
        if inputs.messages is not None:
            prompt = self.process_chat(
                inputs.messages, inputs.chat_options, cache_salt=cache_salt,
                documents=inputs.documents, kv_reuse=inputs.kv_reuse,
                recompute_ratio=inputs.recompute_ratio,
            )
        elif inputs.segments is not None:
            prompt = self.process_segments(inputs.segments, inputs.kv_reuse,
                                           inputs.recompute_ratio)
        else:
            assert inputs.prompt is not None  # PromptInput holds exactly one form
            prompt = self._process_prompt(inputs, token_ids)
        if inputs.truncate_prompt_tokens is not None:
            prompt = self.truncate(prompt, inputs.truncate_prompt_tokens)
        return prompt

    def _process_prompt(self, inputs: PromptInput, token_ids: list[int] | None) -> ProcessedPrompt:
        """Tokenize a text or token-id prompt; with images, each image marker (e.g. "<image>";
        none: one per image at the start, LLaVA's layout) becomes the image's placeholder tokens.
        Token ids mark images with the image token id. The blend separator makes segments."""
        prompt, images = inputs.prompt, list(inputs.images or ())
        assert prompt is not None
        if isinstance(prompt, str) and not images:
            pieces = self.blend_pieces(prompt)
            if pieces is not None:
                return self.process_segments(pieces, inputs.kv_reuse, inputs.recompute_ratio)
        spec = self.image_input  # no marker at all: the images first (some: counts must match)
        if images and spec and isinstance(prompt, str) and spec.image_token not in prompt:
            prompt, token_ids = f"{spec.image_token}\n" * len(images) + prompt, None
        if token_ids is None or not isinstance(prompt, str):
            token_ids = self.encode_prompt(prompt, inputs.add_special_tokens)
        text = prompt if isinstance(prompt, str) else None
        return self._expand_images(token_ids, images, text)

    def blend_pieces(self, text: str) -> list[str] | None:
        """The segments a text prompt becomes (it holds the blend separator), or None: then it
        is encoded whole."""
        if not self.blend_separator:
            return None
        pieces = split_at_separator(text, self.blend_separator)
        return pieces if pieces is not None and len(pieces) >= 2 else None

    def process_any(self, prompt: Any) -> ProcessedPrompt:
        """A prompt in any form the offline API takes (PromptInput.from_offline), or a
        ProcessedPrompt as it is."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        return self.process(PromptInput.from_offline(prompt))

    def process_segments(
        self, segments: Any, kv_reuse: Any = None, recompute_ratio: Any = None
    ) -> ProcessedPrompt:
        """A prompt given as segments (text or token ids), tokenized one by one."""
        token_ids, plan, text = encode_segments(
            segments, self.encode_prompt, kv_reuse=kv_reuse, recompute_ratio=recompute_ratio
        )
        return ProcessedPrompt(token_ids, text, segments=plan)

    def process_chat(
        self,
        messages: list[dict[str, Any]],
        options: ChatOptions | None = None,
        *,
        cache_salt: str | None = None,
        documents: Any = None,
        kv_reuse: Any = None,
        recompute_ratio: Any = None,
    ) -> ProcessedPrompt:
        """Render a conversation whose contents may be OpenAI content-part lists with images.

        OpenAI's message forms are normalised here, once: the "developer" role is "system", a
        null content is empty, text parts are joined by newlines, image parts become the model's
        image marker.
        """
        if not isinstance(messages, list) or not messages:
            validate_messages(messages)
        if documents is not None:
            return self._process_chat_documents(
                messages, options, check_documents(documents), kv_reuse, recompute_ratio
            )
        images: list[Any] = []
        flat = [
            self._flatten_message(i, _normalise_message(m), images) for i, m in enumerate(messages)
        ]
        text, token_ids = self.encode_chat(flat, options, cache_salt=cache_salt)
        try:
            return self._expand_images(token_ids, images, text)
        except InputError:
            raise
        except ValueError as e:  # an unreadable image: the client sent it in messages
            raise InputError("messages", f"messages: {e}") from e

    def _process_chat_documents(
        self,
        messages: list[dict[str, Any]],
        options: ChatOptions | None,
        documents: list[str],
        kv_reuse: Any,
        recompute_ratio: Any,
    ) -> ProcessedPrompt:
        """A text conversation with documents in its system message, as segments."""
        images: list[Any] = []
        flat = [
            self._flatten_message(i, _normalise_message(m), images) for i, m in enumerate(messages)
        ]
        if images:
            raise InputError("documents", "documents cannot be combined with images")
        options = options or ChatOptions()
        rendered = self.render_chat(messages_with_documents_marker(flat), options)
        segments = split_at_documents_marker(rendered, documents)
        special = options.add_special_tokens

        def encode(segment: str | list[int], first: bool) -> list[int]:
            return self.encode_prompt(segment, add_special_tokens=special and first)

        token_ids, plan, text = encode_segments(
            segments, encode, kv_reuse=kv_reuse, recompute_ratio=recompute_ratio
        )
        return ProcessedPrompt(token_ids, text, segments=plan)

    def _flatten_message(self, index: int, message: Any, images: list[Any]) -> Any:
        """A message whose content-part list is joined into one string; images are replaced by
        the model's image marker and collected, in order, into `images`."""
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            return message
        pieces = []
        for j, part in enumerate(message["content"]):
            where = f"messages[{index}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif kind in _IMAGE_PART_TYPES:
                images.append(_image_source(part, where))
                pieces.append(self._image_marker(where))
            else:
                raise InputError(
                    "messages",
                    f"{where} must be {{'type': 'text', 'text': ...}} or an image part of type "
                    f"{list(_IMAGE_PART_TYPES)}, got {part!r:.120}"
                )
        return {**message, "content": "\n".join(pieces)}

    def _image_marker(self, where: str) -> str:
        if self.image_input is None:
            raise InputError(
                "messages", f"{where}: this model does not accept images; send text parts only"
            )
        return self.image_input.image_token

    def _expand_images(
        self, token_ids: list[int], images: list[Any], text: str | None
    ) -> ProcessedPrompt:
        spec = self.image_input
        if spec is None:
            if images:
                raise ValueError("images: this model does not accept images")
            return ProcessedPrompt(token_ids, text)
        from kvmemo.model.models.image_processor import content_hash, load_image, preprocess

        num_markers = token_ids.count(spec.image_token_id)
        if num_markers != len(images):
            raise ValueError(
                f"images: the prompt has {num_markers} image marker(s) {spec.image_token!r} but "
                f"{len(images)} image(s) were given; put one marker where each image goes"
            )
        if not images:
            return ProcessedPrompt(token_ids, text)
        expanded: list[int] = []
        items: list[MultiModalItem] = []
        data: list[Any] = []
        for token in token_ids:
            if token != spec.image_token_id:
                expanded.append(token)
                continue
            pixels = preprocess(load_image(images[len(items)]), spec.processor)  # [3, S, S]
            digest = content_hash(pixels, spec.processor)
            items.append(MultiModalItem(len(expanded), spec.num_image_tokens, digest))
            data.append(pixels)
            expanded.extend([spec.image_token_id] * spec.num_image_tokens)
        return ProcessedPrompt(expanded, text, items, data)

    def encode_texts(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Each non-empty text's token ids, as encode_prompt gives them, in one tokenizer call."""
        if any(not isinstance(t, str) or not t for t in texts):
            raise InputError("prompt", _PROMPT_FORMS)
        encoded = self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
        return [list(ids) for ids in encoded]

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InputError("prompt", _PROMPT_FORMS)
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise InputError("prompt", _PROMPT_FORMS)
        # The common case checked in C (an 8,000-token prompt: ~1 ms less to its first token);
        # a prompt that fails it is walked below for the message.
        if set(map(type, prompt)) == {int} and min(prompt) >= 0 and max(prompt) < self.vocab_size:
            return list(prompt)
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InputError(
                    "prompt",
                    f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}",
                )
        return list(prompt)

    def render_chat(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> str:
        validate_messages(messages)
        options = options or ChatOptions()
        if options.continue_final_message and messages[-1].get("role") != "assistant":
            raise InputError(
                "continue_final_message",
                "continue_final_message needs the last message to be the assistant's",
            )
        kwargs: dict[str, Any] = dict(options.template_kwargs or {})
        if options.tools:
            kwargs["tools"] = options.tools
        try:
            return render_chat_template(
                choose_template(self.template_for(options), bool(options.tools)), messages,
                special_tokens=self.tokenizer.special_tokens_map,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **kwargs,
            )
        except (TypeError, ValueError, jinja2.TemplateError) as e:  # the template refused it
            raise InputError("messages", f"the chat template failed: {e}") from e

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        options: ChatOptions | None = None,
        *,
        cache_salt: str | None = None,
    ) -> tuple[str, list[int]]:
        """The rendered text and its ids; replies generated under the same cache_salt keep
        their generated ids (reply_tokens.py)."""
        options = options or ChatOptions()
        text = self.render_chat(messages, options)
        known = self._encode_with_known_replies(messages, options, text, cache_salt)
        if known is not None:
            return text, known
        # The template already wrote the special tokens: no BOS on top unless asked.
        encoded = self.tokenizer(text, add_special_tokens=options.add_special_tokens)
        return text, list(encoded["input_ids"])

    def _encode_with_known_replies(
        self, messages: list[dict[str, Any]], options: ChatOptions, text: str,
        cache_salt: str | None,
    ) -> list[int] | None:
        """The prompt's ids with each assistant message this engine generated spliced in as
        the ids it was generated as (the text around them tokenized piece by piece); None when
        no message is known or the template does not render contents verbatim."""
        known: dict[int, tuple[int, ...]] = {}
        for i, message in enumerate(messages):
            content = message.get("content")
            if message.get("role") == "assistant" and isinstance(content, str) and content:
                reply_ids = self.reply_tokens.get(content, cache_salt)
                if reply_ids is not None:
                    known[i] = reply_ids
        if not known:
            return None
        marked = [
            {**m, "content": f"\ue000{i}\ue001"} if i in known else m
            for i, m in enumerate(messages)
        ]
        pieces = _MARKER.split(self.render_chat(marked, options))
        # pieces: text, index, text, index, ..., text. Each marker must appear once, and the
        # pieces with the contents put back must be exactly the real rendering.
        indices = [int(p) for p in pieces[1::2]]
        if sorted(indices) != sorted(known) or "".join(
            messages[int(p)]["content"] if k % 2 else p for k, p in enumerate(pieces)
        ) != text:
            return None
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:
                ids.extend(known[int(piece)])
            elif piece:
                special = options.add_special_tokens and k == 0
                ids.extend(self.tokenizer(piece, add_special_tokens=special)["input_ids"])
        return ids

    @staticmethod
    def truncate(prompt: ProcessedPrompt, keep_last: int) -> ProcessedPrompt:
        """The prompt's last `keep_last` tokens (vLLM's truncate_prompt_tokens): a long
        conversation keeps its end. Refused for a prompt with images (it could cut one)."""
        if keep_last < 1:
            raise InputError(
                "truncate_prompt_tokens", f"truncate_prompt_tokens must be >= 1, got {keep_last}"
            )
        if len(prompt.token_ids) <= keep_last:
            return prompt
        if prompt.mm_items:
            raise InputError(
                "truncate_prompt_tokens", "truncate_prompt_tokens cannot cut a prompt with images"
            )
        return ProcessedPrompt(prompt.token_ids[-keep_last:], None)

    def template_for(self, options: ChatOptions | None) -> str | None:
        """The chat template a request renders with."""
        return (options.chat_template if options else None) or self.chat_template


def _image_source(part: dict[str, Any], where: str) -> Any:  # raises InputError
    """The image of an OpenAI image part: {"image_url": {"url": ...}} or {"image_url": "..."},
    {"type": "input_image", "image_url": "..."}, or (offline API) {"type": "image", "image": x}."""
    if part.get("type") == "image":
        if part.get("image") is None:
            raise InputError(
                "messages", f"{where}: an image part needs 'image' (a PIL image, path or bytes)"
            )
        return part["image"]
    value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    # Never a path or a remote URL: a server must not read its own files or fetch for a client.
    if not isinstance(value, str) or not value.startswith("data:"):
        raise InputError(
            "messages",
            f"{where}: image_url.url must be a data: URL (data:image/png;base64,...); "
            "remote URLs and paths are not fetched"
        )
    return value


_MARKER = re.compile("\ue000(\\d+)\ue001")  # an assistant content's place in a rendering


def _normalise_message(message: Any) -> Any:
    if not isinstance(message, dict):
        return message  # validate_messages names what is wrong with it
    out = dict(message)
    role = out.get("role")
    if isinstance(role, str) and role in _ROLE_ALIASES:
        out["role"] = _ROLE_ALIASES[role]
    if "content" in out and out["content"] is None:
        out["content"] = ""
    return out


def validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InputError(
            "messages", "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InputError(
                "messages", f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}"
            )
        if m["role"] not in _ROLES:
            raise InputError(
                "messages", f"messages[{i}].role must be one of {list(_ROLES)}, got {m['role']!r}"
            )
        if not isinstance(m["content"], str):
            raise InputError(
                "messages",
                f"messages[{i}].content must be a string, got {type(m['content']).__name__}",
            )
