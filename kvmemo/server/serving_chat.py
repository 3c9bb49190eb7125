"""POST /v1/chat/completions: messages (text or content parts, images as data: URLs) in,
`chat.completion` objects or `chat.completion.chunk` events out, with the `content` logprobs
layout; streams open with an assistant-role delta per choice.

Invariant: without max_tokens (or max_completion_tokens) a reply may fill the rest of the
context.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kvmemo.errors import InputError
from kvmemo.intake.processor import ChatOptions
from kvmemo.server.protocol import ChatCompletionRequest, ChatMessage, ImagePart
from kvmemo.server.serving_common import Choice, Job, OpenAIServing, TokenLogprob


class ServingChat(OpenAIServing):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        ignored = self.check_common(body)
        messages = [_engine_message(i, message) for i, message in enumerate(body.messages)]
        if body.top_logprobs is not None and not body.logprobs:
            raise InputError("top_logprobs", "top_logprobs requires logprobs: true")
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        # Without max_tokens the engine fills the context (fill_context); until then any value
        # min_tokens allows stands in.
        params = self.sampling_params(body, max_tokens or max(1, body.min_tokens), top_logprobs)
        options = ChatOptions(
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            add_special_tokens=body.add_special_tokens,
            template_kwargs=body.chat_template_kwargs,
            chat_template=body.chat_template,
        )
        last = messages[-1]
        # vLLM's chat echo: a reply that continues the assistant's last message starts with it.
        echo_prefix = last["content"] if body.echo and last["role"] == "assistant" else ""
        if not isinstance(echo_prefix, str):  # content parts with images: nothing to echo
            echo_prefix = ""
        return await self.generate(
            body,
            request,
            params,
            top_logprobs,
            ignored_fields=ignored,
            messages=messages,
            fill_context=max_tokens is None,
            chat_options=options,
            echo_prefix=echo_prefix,
        )

    def choice_fields(self, job: Job, choice: Choice) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": job.echo_prefix + choice.text}}

    def delta_fields(self, job: Job, choice: Choice, delta: str) -> dict[str, Any]:
        if job.echo_prefix and not choice.echo_sent:  # the choice's first content chunk
            delta = job.echo_prefix + delta
        return {"delta": {"content": delta} if delta else {}}

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(n)
        ]

    def logprobs_json(
        self, job: Job, choice: Choice, start: int, entries: list[TokenLogprob]
    ) -> dict[str, Any]:
        def item(token_id: int, logprob: float | None) -> dict[str, Any]:
            text = job.token_text(token_id)
            return {"token": job.logprob_token(token_id), "logprob": logprob,
                    "bytes": list(text.encode())}

        return {
            "content": [
                {**item(e.token_id, e.logprob), "top_logprobs": [item(i, v) for i, v in top]}
                for e in entries
                for top in (e.top or [],)
            ]
        }


def _engine_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A ChatMessage as the engine's chat template takes it."""
    content = message.content
    if isinstance(content, list):
        if any(isinstance(part, ImagePart) for part in content):
            # The processor loads the images (data: URLs only) and places them; a text-only
            # model or a bad image is an InputError, so a 400.
            content = [part.model_dump() for part in content]
            if any(part["type"] == "image" for part in content):
                raise InputError(
                    "messages",
                    f"messages[{index}].content: send images as image_url parts with a data: URL",
                )
        else:
            content = "\n".join(part.text for part in content)
    # The template knows system, not OpenAI's newer "developer" name for it.
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content or ""}
