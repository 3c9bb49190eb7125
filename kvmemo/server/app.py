"""The HTTP server: OpenAI's routes (completions, chat, Responses) and Anthropic's Messages route
over an AsyncEngine.

Invariant: every error leaves as OpenAI's {"error": {...}} JSON (Anthropic's shape on
/v1/messages; bad input 400, bad key 401, full queue 503), and a request whose client goes away
is aborted, so its KV blocks are freed. This module only wires: the serving objects
(serving_completion, serving_chat, serving_messages, serving_responses) handle the generation
routes, errors.py the error bodies, kv_routes.py the /kv routes, token_routes.py /tokenize,
/detokenize and /version.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvmemo.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvmemo.server.errors import APIError, add_error_handlers
from kvmemo.server.kv_routes import add_kv_routes
from kvmemo.server.metrics import ServerMetrics
from kvmemo.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from kvmemo.server.responses_protocol import ResponsesRequest
from kvmemo.server.serving_chat import ServingChat
from kvmemo.server.serving_common import CLIENT_CLOSED
from kvmemo.server.serving_completion import ServingCompletion
from kvmemo.server.serving_messages import ServingMessages
from kvmemo.server.serving_responses import ServingResponses
from kvmemo.server.token_routes import add_token_routes

if TYPE_CHECKING:
    from kvmemo.engine import AsyncEngine
    from kvmemo.server.kv_events import EventPublisher

_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/models",
    "/health",
    "/metrics",
    "/reset_prefix_cache",
    "/tokenize",
    "/detokenize",
    "/version",
    "/kv/info",
    "/kv/blocks",
)


def create_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    kv_events: EventPublisher | None = None,
    replica_tag: str | None = None,
) -> FastAPI:
    """Build the app around a running AsyncEngine; the app shuts the engine down on exit.

    kv_events: the publisher the engine's KV events go to, named by GET /kv/info.
    replica_tag: the tag in the app's response ids (server/response_store.py).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="kvmemo", version="0.1.0", lifespan=lifespan)
    metrics = ServerMetrics(engine)
    app.add_middleware(_CountRequests, metrics=metrics)
    add_error_handlers(app)
    completion = ServingCompletion(engine, metrics, model_name)
    chat = ServingChat(engine, metrics, model_name)
    messages = ServingMessages(engine, metrics, model_name)
    responses = ServingResponses(engine, metrics, model_name, replica_tag=replica_tag)
    auth = [Depends(_key_check(api_key))]

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        return await completion.create(body, request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    @app.post("/v1/messages", dependencies=auth)
    async def create_message(body: MessagesRequest, request: Request):
        return await messages.create_message(body, request)

    @app.post("/v1/messages/count_tokens", dependencies=auth)
    async def count_message_tokens(body: CountTokensRequest):
        return await messages.count_tokens(body)

    @app.post("/v1/responses", dependencies=auth)
    async def create_response(body: ResponsesRequest, request: Request):
        return await responses.create_response(body, request)

    @app.get("/v1/responses/{response_id}", dependencies=auth)
    async def retrieve_response(response_id: str, cache_salt: str | None = None):
        return responses.retrieve(response_id, cache_salt)

    @app.delete("/v1/responses/{response_id}", dependencies=auth)
    async def delete_response(response_id: str, cache_salt: str | None = None):
        return responses.delete(response_id, cache_salt)

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

    add_kv_routes(app, engine, kv_events, model_name, replica_id=responses.replica_tag)
    add_token_routes(app, engine, model_name, auth)
    return app


def _key_check(api_key: str | None) -> Callable[[Request], None]:
    """The dependency guarding the keyed routes: 401 unless `Authorization: Bearer <api_key>`
    or (Anthropic's header) `x-api-key: <api_key>`."""

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401,
                "missing or invalid API key (send Authorization: Bearer <key> or x-api-key)",
                "authentication_error",
                code="invalid_api_key",
            )

    return check_key


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
        status = [CLIENT_CLOSED]

        async def send_and_record(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(route, str(status[0])).inc()
