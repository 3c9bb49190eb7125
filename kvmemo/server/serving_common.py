"""What the two generation routes share: the checks and SamplingParams both take, the JSON and
server-sent-event response loops over a Job (job.py), disconnect handling, and the metrics and
log line of each finished request.

Invariant: every Job's engine stream is aborted on every way out (finished, client gone, error;
a no-op once finished), so its KV blocks are freed, and it is recorded exactly once. What
differs between the APIs (ids, object names, choice and chunk fields, the logprobs layout) is
left to the subclasses in serving_completion.py and serving_chat.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmemo.engine import AsyncEngine, EngineDeadError
from kvmemo.errors import InputError
from kvmemo.intake.prompt_input import PromptInput
from kvmemo.kv.retention import Retention
from kvmemo.outputs import RequestOutputKind
from kvmemo.sampling import SamplingParams
from kvmemo.server.errors import APIError, error_body
from kvmemo.server.job import Choice, Job, TokenLogprob
from kvmemo.server.metrics import ServerMetrics
from kvmemo.server.protocol import ChatCompletionRequest, CompletionRequest, check_unsupported

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; only ever seen in metrics
_MIN_TEMPERATURE = 1e-5  # below this (and above 0) sampling is greedy


class OpenAIServing:
    """One generation route: validated request in, engine request, OpenAI JSON or SSE out.

    Subclasses set the names and implement the fields their API formats differently.
    """

    # Unknown fields already warned about, in this process (both APIs share one set).
    _warned_fields: ClassVar[set[str]] = set()

    object_name: str  # of the full response
    chunk_object_name: str  # of each streamed chunk
    id_prefix: str  # of the response id, before the engine request id

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_name: str):
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name

    # ---- the API-specific parts ------------------------------------------------------------

    def choice_fields(self, job: Job, choice: Choice) -> dict[str, Any]:
        """A full response's choice content ("text", "message")."""
        raise NotImplementedError

    def delta_fields(self, job: Job, choice: Choice, delta: str) -> dict[str, Any] | None:
        """A streamed chunk's choice content for `delta`, the choice's new text; None: send
        nothing yet."""
        raise NotImplementedError

    def finish_reason(self, job: Job, choice: Choice) -> str | None:
        return choice.finish_reason

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        """The choices of a chunk sent before any output; none: no such chunk."""
        return []

    def logprobs_json(
        self, job: Job, choice: Choice, start: int, entries: list[TokenLogprob]
    ) -> dict[str, Any]:
        """`entries`, the logprobs of `choice`'s tokens from position `start` on."""
        raise NotImplementedError

    # ---- shared ------------------------------------------------------------------------------

    def check_common(self, body: CompletionRequest | ChatCompletionRequest) -> list[str]:
        """Raises for a bad model or an unsupported value; returns the unknown fields, which
        are ignored (logged once per name, and named in the kvmemo-ignored-fields header)."""
        unknown = check_unsupported(body.model_extra or {})
        for name in unknown:
            if name not in self._warned_fields:
                self._warned_fields.add(name)
                logger.warning("ignoring unknown request field %r (said once per field)", name)
        check_model(body.model, self.model_name)
        return unknown

    @staticmethod
    def sampling_params(
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        stop = body.stop if body.stop is not None else ()
        temperature = 1.0 if body.temperature is None else body.temperature
        if 0.0 < temperature < _MIN_TEMPERATURE:
            # The limit of sampling as temperature -> 0 is greedy; dividing the logits by a
            # vanishing temperature would overflow them to inf (vLLM does the same).
            temperature = 0.0
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            stop=stop if isinstance(stop, str) else tuple(stop),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=_token_biases(body.logit_bias),
            min_tokens=body.min_tokens,
            bad_words=tuple(body.bad_words or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            allowed_token_ids=body.allowed_token_ids,
            structured_outputs=body.structured_outputs_params(),
            output_kind=RequestOutputKind.DELTA,  # Job.update gathers them
        )

    async def generate(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        request: Request,
        params: SamplingParams,
        top_logprobs: int | None,
        inputs: PromptInput,
        *,
        ignored_fields: list[str] | None = None,
        echo: bool = False,
        echo_prefix: str = "",
        tool_replies: Any = None,
        fill_context: bool = False,
    ) -> Response:
        """Queue the request (`inputs`: its prompt, chat or segments) and answer it.
        echo: completions' (the prompt leads the text); echo_prefix: chat's (the last
        assistant message's content leads the reply)."""
        headers = {"kvmemo-ignored-fields": ",".join(ignored_fields)} if ignored_fields else None
        truncate = body.truncate_prompt_tokens
        inputs = dataclasses.replace(
            inputs, truncate_prompt_tokens=self.engine.max_model_len if truncate == -1 else truncate
        )
        stream = await self.engine.add_request(
            params, inputs, cache_salt=body.cache_salt, retention=self.retention_of(body),
            priority=body.priority,
            request_id=uuid.uuid4().hex[:24], echo=echo, fill_context=fill_context,
        )
        job = Job(stream, params.n, top_logprobs, echo=echo, echo_prefix=echo_prefix,
                  tokens_as_ids=body.return_tokens_as_token_ids, name=body.request_id,
                  tool_replies=tool_replies)
        if body.stream:
            options = body.stream_options
            include_usage = options is not None and options.include_usage
            continuous_usage = options is not None and options.continuous_usage_stats
            return StreamingResponse(
                self.stream_events(job, include_usage, continuous_usage),
                media_type="text/event-stream",
                headers=headers,
            )
        try:
            finished = await _until_done_or_disconnect(_collect(job), request)
        finally:
            job.stream.abort()  # no-op once finished
            self.record(job)
        if not finished:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(self.full_response(job), headers=headers)

    def retention_of(
        self, body: CompletionRequest | ChatCompletionRequest
    ) -> tuple[Retention, ...]:
        """The prompt prefixes this request keeps cached after it ends (the agent routes'
        cache hints: kv/retention.py); none on the OpenAI-compatible routes."""
        return ()

    @staticmethod
    def prompt_logprobs_field(job: Job, first_chunk: bool = True) -> dict[str, Any]:
        """{"prompt_logprobs": [...]} for a request that asked for them (in a stream, only
        the choice's first chunk), else {}."""
        if job.prompt_logprobs is None or not first_chunk:
            return {}
        return {"prompt_logprobs": job.prompt_logprobs_json()}

    def response_id(self, job: Job) -> str:
        return self.id_prefix + (job.name or job.stream.request_id)

    def new_logprobs(self, job: Job, choice: Choice) -> dict[str, Any] | None:
        """The logprobs of tokens not yet sent, in the API's layout (and mark them sent)."""
        if job.top_logprobs is None:
            return None
        start, entries = job.take_logprobs(choice)
        return self.logprobs_json(job, choice, start, entries)

    def full_response(self, job: Job) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(job.choices):
            logprobs = self.new_logprobs(job, c)
            choices.append({
                "index": i,
                **self.choice_fields(job, c),
                "logprobs": logprobs,
                "finish_reason": self.finish_reason(job, c),
                **self.prompt_logprobs_field(job),
            })
        return {
            "id": self.response_id(job),
            "object": self.object_name,
            "created": job.created,
            "model": self.model_name,
            "choices": choices,
            "usage": job.usage(),
        }

    async def stream_events(
        self, job: Job, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[str]:
        """The SSE stream; continuous_usage: every content chunk carries the usage so far."""
        base = {
            "id": self.response_id(job),
            "object": self.chunk_object_name,
            "created": job.created,
            "model": self.model_name,
        }

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

        try:
            opening = self.opening_choices(job.n)
            if opening:
                yield event(opening, **({"usage": job.usage()} if continuous_usage else {}))
            async for item in job.stream:
                choice, delta = job.update(item)
                if not delta and choice.finish_reason is None and job.top_logprobs is None:
                    continue
                fields = self.delta_fields(job, choice, delta)
                if fields is None:  # held back (a reply that may be a tool call)
                    continue
                logprobs = self.new_logprobs(job, choice)
                yield event(
                    [
                        {
                            "index": item.index,
                            **fields,
                            "logprobs": logprobs,
                            "finish_reason": self.finish_reason(job, choice),
                            **self.prompt_logprobs_field(job, first_chunk=not choice.echo_sent),
                        }
                    ],
                    **({"usage": job.usage()} if continuous_usage else {}),
                )
                choice.echo_sent = True
            if include_usage:
                yield event([], usage=job.usage())
        except EngineDeadError as e:
            body = error_body(str(e), "server_error", code="engine_unavailable")
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            job.stream.abort()  # the client left (generator closed) or an error: free the blocks
            self.record(job)
        yield "data: [DONE]\n\n"

    def record(self, job: Job) -> None:
        completion_tokens = sum(c.num_tokens for c in job.choices)
        latency = time.monotonic() - job.start
        m = self.metrics
        m.prompt_tokens.inc(job.num_prompt_tokens)
        m.cached_tokens.inc(job.num_cached_tokens)
        m.generation_tokens.inc(completion_tokens)
        for drafts, drafted, kept in job.drafts.values():
            m.spec_drafts.inc(drafts)
            m.spec_draft_tokens.inc(drafted)
            m.spec_accepted_tokens.inc(kept)
        m.latency.observe(latency)
        if job.ttft_s is not None:
            m.ttft.observe(job.ttft_s)
        reasons = ",".join(c.finish_reason or "abort" for c in job.choices)
        logger.info(
            "request %s: prompt %d tokens, cached %d, completion %d, ttft %s, latency %.3f s, "
            "finish %s",
            job.stream.request_id,
            job.num_prompt_tokens,
            job.num_cached_tokens,
            completion_tokens,
            "-" if job.ttft_s is None else f"{job.ttft_s:.3f} s",
            latency,
            reasons,
        )


def check_model(requested: str | None, served: str) -> None:
    """400 model_not_found unless the request names the served model (or none)."""
    if requested is not None and requested != served:
        raise APIError(
            400,
            f"unknown model {requested!r}; this server serves {served!r}",
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )


async def _collect(job: Job) -> None:
    async for item in job.stream:
        job.update(item)


async def _until_done_or_disconnect(work, request: Request) -> bool:
    """Run `work`; return False (and cancel it) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watch_task = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task in done:
        work_task.result()  # re-raise the engine's error
        return True
    return False


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} (JSON keys are strings) -> {token id: bias}."""
    if not logit_bias:
        return None
    biases = {}
    for key, value in logit_bias.items():
        if not key.strip().isdigit():
            raise InputError(
                "logit_bias", f"logit_bias keys must be token ids (digits), got {key!r}"
            )
        biases[int(key)] = value
    return biases
