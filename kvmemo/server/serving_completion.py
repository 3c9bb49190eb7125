"""POST /v1/completions: a prompt (text or token ids) in, `text_completion` objects out, with
the legacy logprobs layout (tokens, token_logprobs, top_logprobs, text_offset).

Invariant: one prompt per request; a batch of prompts is refused (400), never half served.
"""

from __future__ import annotations

from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response

from kvmemo.intake.prompt_input import PromptInput
from kvmemo.server.job import Choice, Job, TokenLogprob
from kvmemo.server.protocol import CompletionRequest, UnsupportedFieldError
from kvmemo.server.serving_common import OpenAIServing

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
        # echo with logprobs: the prompt's tokens get logprobs too (as vLLM and OpenAI's legacy
        # API give them; lm-eval's loglikelihood reads them).
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        params = self.sampling_params(
            body, body.max_tokens or _DEFAULT_MAX_TOKENS, body.logprobs, prompt_logprobs
        )
        if body.segments is not None:
            inputs = PromptInput(segments=body.segments, kv_reuse=body.kv_reuse,
                                 recompute_ratio=body.recompute_ratio)
        else:
            inputs = PromptInput(prompt=cast("str | list[int]", prompt),  # one prompt, unwrapped
                                 add_special_tokens=body.add_special_tokens,
                                 kv_reuse=body.kv_reuse, recompute_ratio=body.recompute_ratio)
        return await self.generate(
            body, request, params, body.logprobs, inputs, ignored_fields=ignored, echo=body.echo,
        )

    def choice_fields(self, job: Job, choice: Choice) -> dict[str, Any]:
        return {"text": (job.stream.prompt_text if job.echo else "") + choice.text}

    def delta_fields(self, job: Job, choice: Choice, delta: str) -> dict[str, Any]:
        if job.echo and not choice.echo_sent:  # the choice's first chunk
            delta = job.stream.prompt_text + delta
        return {"text": delta}

    def new_logprobs(self, job: Job, choice: Choice) -> dict[str, Any] | None:
        if not (job.echo and job.top_logprobs is not None and not choice.echo_sent):
            return super().new_logprobs(job, choice)
        # The first chunk (or the full response) of an echo: the prompt's entries lead.
        prompt = job.prompt_entries() if job.prompt_logprobs is not None else []
        start, entries = job.take_logprobs(choice)
        assert start == 0
        logprobs = self.logprobs_json(job, choice, 0, prompt + entries, prompt_offset=0)
        choice.logprob_chars = sum(len(job.token_text(e.token_id)) for e in entries)
        return logprobs

    def logprobs_json(
        self,
        job: Job,
        choice: Choice,
        start: int,
        entries: list[TokenLogprob],
        prompt_offset: int | None = None,
    ) -> dict[str, Any]:
        """prompt_offset: where the entries' text starts (0 for an echo's leading prompt);
        otherwise after the prompt (if echoed) and the choice's first `start` tokens."""
        text = job.token_text
        offset = prompt_offset
        base = 0
        if offset is None:  # after the prompt (if echoed) and the tokens already sent
            base = len(job.stream.prompt_text) if job.echo else 0
            offset = base + choice.logprob_chars
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(text(e.token_id))
        if prompt_offset is None:
            choice.logprob_chars = offset - base
        name = job.logprob_token
        return {
            "tokens": [name(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                None if e.top is None else {name(i): v for i, v in e.top} for e in entries
            ],
            "text_offset": offsets,
        }
