"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine.

Invariant: every error leaves as OpenAI's {"error": {...}} JSON (bad input 400, bad key 401,
full queue 503), and a request whose client goes away is aborted, so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kvmemo.engine import (
    AsyncEngine,
    EngineDeadError,
    RequestStream,
    StreamItem,
)
from kvmemo.sampling import SamplingParams
from kvmemo.server.errors import APIError, add_error_handlers, error_body
from kvmemo.server.kv_routes import add_kv_routes
from kvmemo.server.metrics import ServerMetrics
from kvmemo.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ImagePart,
    ModelCard,
    ModelList,
    UnsupportedFieldError,
    check_unsupported,
)

if TYPE_CHECKING:
    from kvmemo.server.kv_events import KVEventPublisher

logger = logging.getLogger(__name__)

_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/reset_prefix_cache",
    "/kv/info",
    "/kv/blocks",
)
_MIN_TEMPERATURE = 1e-5  # below this (and above 0) sampling is greedy
_CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; only ever seen in metrics


def create_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    kv_events: KVEventPublisher | None = None,
) -> FastAPI:
    """Build the app around a running AsyncEngine; the app shuts the engine down on exit.

    kv_events: the publisher the engine's KV events go to, named by GET /kv/info.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="kvmemo", version="0.1.0", lifespan=lifespan)
    metrics = ServerMetrics(engine)
    app.add_middleware(_CountRequests, metrics=metrics)
    server = _Server(engine, metrics, model_name)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(
                401,
                "missing or invalid API key (send Authorization: Bearer <key>)",
                "authentication_error",
                code="invalid_api_key",
            )

    auth = [Depends(check_key)]
    add_error_handlers(app)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=engine.max_model_len)])

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            raise APIError(
                503, "the engine is not running", "server_error", code="engine_unavailable"
            )
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache", dependencies=auth)
    async def reset_prefix_cache():
        ok, reason = await engine.reset_prefix_cache()
        if not ok:
            raise APIError(
                409, f"prefix cache not reset: {reason}", "conflict_error", code="cache_in_use"
            )
        return {"success": True}

    add_kv_routes(app, engine, kv_events, model_name)
    return app


class _CountRequests:
    """ASGI middleware counting requests by route and status.

    Pure ASGI rather than BaseHTTPMiddleware, so handlers still see the client's disconnect.
    """

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in _ROUTES else "other"
        status = [_CLIENT_CLOSED]

        async def send_and_record(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(route, str(status[0])).inc()


# ---- request handling -----------------------------------------------------------------------


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    num_logprobs_sent: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _Job:
    """One HTTP generation request: its engine stream and what it produced so far."""

    kind: str  # "completion" or "chat"
    stream: RequestStream
    n: int
    top_logprobs: int | None  # None = no logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[_Choice] = field(default_factory=list)
    token_texts: dict[int, str] = field(default_factory=dict)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    start: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.choices = [_Choice() for _ in range(self.n)]

    def update(self, item: StreamItem) -> tuple[_Choice, str]:
        """Record one engine output; returns the choice and its new text."""
        out = item.output
        completion = out.outputs[0]
        choice = self.choices[item.index]
        delta = (
            completion.text[len(choice.text) :] if completion.text.startswith(choice.text) else ""
        )
        if delta:
            choice.text = completion.text
        choice.num_tokens = len(completion.token_ids)
        choice.token_ids = completion.token_ids
        choice.finish_reason = completion.finish_reason
        if completion.logprobs is not None:
            choice.logprobs = completion.logprobs
        self.token_texts.update(item.token_texts)
        if item.index == 0:
            self.num_prompt_tokens = out.metrics.num_prompt_tokens
            self.num_cached_tokens = out.metrics.num_cached_tokens
        if self.ttft_s is None and out.metrics.first_token_time is not None:
            self.ttft_s = time.monotonic() - self.start
        return choice, delta

    def usage(self) -> dict[str, Any]:
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.num_prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }

    def new_logprobs(self, choice: _Choice) -> dict[str, Any] | None:
        """The logprobs of tokens not yet sent, in the route's format (and mark them sent)."""
        if self.top_logprobs is None:
            return None
        start, choice.num_logprobs_sent = choice.num_logprobs_sent, len(choice.logprobs)
        entries = []
        for i in range(start, len(choice.logprobs)):
            entry = choice.logprobs[i]
            token_id = choice.token_ids[i]
            top = sorted(entry.items(), key=lambda kv: -kv[1])[: self.top_logprobs]
            entries.append((token_id, entry[token_id], top))
        text = self.token_texts.get
        if self.kind == "chat":

            def item(token_id: int, logprob: float) -> dict[str, Any]:
                token = text(token_id, "")
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {
                "content": [
                    {**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                    for t, lp, top in entries
                ]
            }
        offsets, offset = [], sum(len(text(t, "")) for t in choice.token_ids[:start])
        for t, _, _ in entries:
            offsets.append(offset)
            offset += len(text(t, ""))
        return {
            "tokens": [text(t, "") for t, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{text(i, ""): v for i, v in top} for _, _, top in entries],
            "text_offset": offsets,
        }


class _Server:
    """Turns validated requests into engine requests and engine outputs into OpenAI JSON."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_name: str):
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_common(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise UnsupportedFieldError(
                    "prompt",
                    "prompt: batches of prompts are not supported; send one prompt per request",
                )
            prompt = prompt[0]
        params = self._sampling_params(body, body.max_tokens or 16, body.logprobs)
        stream = await self.engine.add_request(
            params, prompt=prompt, cache_salt=body.cache_salt, request_id=uuid.uuid4().hex[:24]
        )
        job = _Job("completion", stream, params.n, body.logprobs)
        return await self._respond(job, body, request)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_common(body)
        messages = []
        for i, message in enumerate(body.messages):
            content = message.content
            if isinstance(content, list):
                if any(isinstance(part, ImagePart) for part in content):
                    # The processor loads the images (data: URLs only) and places them; a
                    # text-only model or a bad image is a ValueError, so a 400.
                    content = [part.model_dump() for part in content]
                    if any(part["type"] == "image" for part in content):
                        raise UnsupportedFieldError(
                            "messages",
                            f"messages[{i}].content: send images as image_url parts with a "
                            "data: URL",
                        )
                else:
                    content = "\n".join(part.text for part in content)
            # The template knows system, not OpenAI's newer "developer" name for it.
            role = "system" if message.role == "developer" else message.role
            messages.append({"role": role, "content": content or ""})
        if body.top_logprobs is not None and not body.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs requires logprobs: true")
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = self._sampling_params(body, max_tokens or 1, top_logprobs)
        stream = await self.engine.add_request(
            params,
            messages=messages,
            cache_salt=body.cache_salt,
            fill_context=max_tokens is None,
            request_id=uuid.uuid4().hex[:24],
        )
        job = _Job("chat", stream, params.n, top_logprobs)
        return await self._respond(job, body, request)

    def _check_common(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        check_unsupported(body.model_extra or {})
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                400,
                f"unknown model {body.model!r}; this server serves {self.model_name!r}",
                "invalid_request_error",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def _sampling_params(body, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
        )

    async def _respond(self, job: _Job, body, request: Request):
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                self._stream(job, include_usage), media_type="text/event-stream"
            )
        try:
            finished = await _until_done_or_disconnect(self._collect(job), request)
        finally:
            job.stream.abort()  # no-op once finished
            self._record(job)
        if not finished:
            return Response(status_code=_CLIENT_CLOSED)
        return JSONResponse(self._full_response(job))

    async def _collect(self, job: _Job) -> None:
        async for item in job.stream:
            job.update(item)

    def _full_response(self, job: _Job) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(job.choices):
            if job.kind == "chat":
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": job.new_logprobs(c),
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": i,
                        "text": c.text,
                        "logprobs": job.new_logprobs(c),
                        "finish_reason": c.finish_reason,
                    }
                )
        return {
            "id": self._response_id(job),
            "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": job.created,
            "model": self.model_name,
            "choices": choices,
            "usage": job.usage(),
        }

    def _response_id(self, job: _Job) -> str:
        return ("chatcmpl-" if job.kind == "chat" else "cmpl-") + job.stream.request_id

    async def _stream(self, job: _Job, include_usage: bool) -> AsyncIterator[str]:
        chat = job.kind == "chat"
        base = {
            "id": self._response_id(job),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": job.created,
            "model": self.model_name,
        }

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

        try:
            if chat:
                yield event(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for i in range(job.n)
                    ]
                )
            async for item in job.stream:
                choice, delta = job.update(item)
                if not delta and choice.finish_reason is None and job.top_logprobs is None:
                    continue
                logprobs = job.new_logprobs(choice)
                if chat:
                    payload = {"delta": {"content": delta} if delta else {}}
                else:
                    payload = {"text": delta}
                yield event(
                    [
                        {
                            "index": item.index,
                            **payload,
                            "logprobs": logprobs,
                            "finish_reason": choice.finish_reason,
                        }
                    ]
                )
            if include_usage:
                yield event([], usage=job.usage())
        except EngineDeadError as e:
            body = error_body(str(e), "server_error", code="engine_unavailable")
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            job.stream.abort()  # the client left (generator closed) or an error: free the blocks
            self._record(job)
        yield "data: [DONE]\n\n"

    def _record(self, job: _Job) -> None:
        completion_tokens = sum(c.num_tokens for c in job.choices)
        latency = time.monotonic() - job.start
        m = self.metrics
        m.prompt_tokens.inc(job.num_prompt_tokens)
        m.cached_tokens.inc(job.num_cached_tokens)
        m.generation_tokens.inc(completion_tokens)
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
