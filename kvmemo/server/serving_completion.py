"""POST /v1/completions: a prompt (text or token ids) in, `text_completion` objects out, with
the legacy logprobs layout (tokens, token_logprobs, top_logprobs, text_offset).

Invariant: one prompt per request; a batch of prompts is refused (400), never half served.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kvmemo.server.protocol import CompletionRequest, UnsupportedFieldError
from kvmemo.server.serving_common import Choice, Job, OpenAIServing, TokenLogprob

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class ServingCompletion(OpenAIServing):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        ignored = self.check_common(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise UnsupportedFieldError(
                    "prompt",
                    "prompt: batches of prompts are not supported; send one prompt per request",
                )
            prompt = prompt[0]
        params = self.sampling_params(body, body.max_tokens or _DEFAULT_MAX_TOKENS, body.logprobs)
        return await self.generate(
            body, request, params, body.logprobs, ignored_fields=ignored, prompt=prompt
        )

    def choice_fields(self, choice: Choice) -> dict[str, Any]:
        return {"text": choice.text}

    def delta_fields(self, delta: str) -> dict[str, Any]:
        return {"text": delta}

    def logprobs_json(
        self, job: Job, choice: Choice, start: int, entries: list[TokenLogprob]
    ) -> dict[str, Any]:
        text = job.token_text
        offsets, offset = [], sum(len(text(t)) for t in choice.token_ids[:start])
        for e in entries:
            offsets.append(offset)
            offset += len(text(e.token_id))
        return {
            "tokens": [text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(i): v for i, v in e.top} for e in entries],
            "text_offset": offsets,
        }
