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
from kvmemo.intake.chat_options import ChatOptions
from kvmemo.intake.prompt_input import PromptInput
from kvmemo.intake.tools import constrain_reply, render_tools
from kvmemo.sampling import SamplingParams
from kvmemo.server.chat_input import chat_options, chat_tools, engine_messages
from kvmemo.server.job import Choice, Job, TokenLogprob
from kvmemo.server.protocol import ChatCompletionRequest
from kvmemo.server.serving_common import OpenAIServing
from kvmemo.server.tool_replies import ToolReplies


class ServingChat(OpenAIServing):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        ignored = self.check_common(body)
        messages = engine_messages(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise InputError("top_logprobs", "top_logprobs requires logprobs: true")
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        # Without max_tokens the engine fills the context (fill_context); until then any value
        # min_tokens allows stands in.
        params = self.sampling_params(body, max_tokens or max(1, body.min_tokens), top_logprobs)
        options = chat_options(body)
        tool_replies, params, messages, options = self._with_tools(
            body, params, messages, options
        )
        last = messages[-1]
        # vLLM's chat echo: a reply that continues the assistant's last message starts with it.
        echo_prefix = last["content"] if body.echo and last["role"] == "assistant" else ""
        if not isinstance(echo_prefix, str):  # content parts with images: nothing to echo
            echo_prefix = ""
        try:
            inputs = PromptInput(messages=messages, chat_options=options,
                                 documents=body.documents, kv_reuse=body.kv_reuse,
                                 recompute_ratio=body.recompute_ratio)
            return await self.generate(
                body, request, params, top_logprobs, inputs, ignored_fields=ignored,
                fill_context=max_tokens is None, echo_prefix=echo_prefix,
                tool_replies=tool_replies,
            )
        except InputError as e:
            if tool_replies is not None and e.param == "structured_outputs":
                # The constraint came from the tools' schemas: name what the client sent.
                raise InputError("tools", f"a tool's parameters do not compile: {e}") from None
            raise

    def _with_tools(
        self,
        body: ChatCompletionRequest,
        params: SamplingParams,
        messages: list[dict[str, Any]],
        options: ChatOptions,
    ) -> tuple[ToolReplies | None, SamplingParams, list[dict[str, Any]], ChatOptions]:
        """Tools rendered into the prompt (intake.tools, as the router's hasher renders them), a
        `required` or named choice as the reply's constraint, and the ToolReplies that parse the
        answer; unchanged without tools or tool history."""
        rendering = render_tools(messages, options, chat_tools(body),
                                 body.chat_template or self.engine.chat_template)
        prompt = rendering.prompt
        if prompt is None:
            return None, params, messages, options
        params = constrain_reply(params, prompt)
        replies = ToolReplies(list(prompt.tools), prompt.reply_format) if prompt.parses_calls \
            else None
        return replies, params, rendering.messages, rendering.options

    def choice_fields(self, job: Job, choice: Choice) -> dict[str, Any]:
        if job.tool_replies is not None:
            message = job.tool_replies.message(choice.index, choice.text, choice.finish_reason)
            return {"message": message}
        return {"message": {"role": "assistant", "content": job.echo_prefix + choice.text}}

    def delta_fields(self, job: Job, choice: Choice, delta: str) -> dict[str, Any] | None:
        if job.tool_replies is not None:
            tool_delta = job.tool_replies.delta(choice.index, delta, choice.finish_reason)
            return None if tool_delta is None else {"delta": tool_delta}
        if job.echo_prefix and not choice.echo_sent:  # the choice's first content chunk
            delta = job.echo_prefix + delta
        return {"delta": {"content": delta} if delta else {}}

    def finish_reason(self, job: Job, choice: Choice) -> str | None:
        if job.tool_replies is not None:
            return job.tool_replies.finish_reason(choice.index, choice.text, choice.finish_reason)
        return choice.finish_reason

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

        content = []
        for e in entries:
            top = [item(i, v) for i, v in e.top or ()]
            content.append({**item(e.token_id, e.logprob), "top_logprobs": top})
        return {"content": content}
