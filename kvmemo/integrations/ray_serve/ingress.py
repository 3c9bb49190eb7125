"""KvmemoIngress: the OpenAI-compatible front of kvmemo on Ray Serve.

It hashes each generation request's prompt as the replicas will (kvmemo.routing.prompt_hasher,
the same code `kvmemo router` uses), hands the request to the engine deployment through a Ray
Serve handle, whose request router picks the replica, and streams the replica's response back.

Invariant: the client sees nothing of an answer until its first body chunk exists, so a replica
that dies before then (killed, node lost) costs the request nothing: it is sent again, to another
replica, up to `max_attempts` times. Once bytes went out, a death ends the stream.
"""


import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from kvmemo.integrations.ray_serve.http_call import HTTPCall
from kvmemo.server.errors import APIError, add_error_handlers

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages",
                    "/v1/responses")
_DROPPED_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}

api = FastAPI(title="kvmemo on Ray Serve", version="0.1.0")
add_error_handlers(api)


async def _rest(first: bytes, stream: Any) -> AsyncIterator[bytes]:
    """The body: the chunk already read, then the rest; cancels the replica's call when the
    client goes away."""
    try:
        if first:
            yield first
        async for chunk in stream:
            yield chunk
    finally:
        stream.cancel()


_STORED_PREFIX = "/v1/responses/"  # GET / DELETE of a stored response


def _response_tag(call: HTTPCall) -> str | None:
    """The stored response this call continues or reads names its replica's tag."""
    from kvmemo.server.response_store import tag_of

    if call.path.startswith(_STORED_PREFIX) and call.method in ("GET", "DELETE"):
        return tag_of(call.path[len(_STORED_PREFIX):])
    body = call.json_body
    if call.path == "/v1/responses" and isinstance(body, dict):
        return tag_of(body.get("previous_response_id"))
    return None


@serve.ingress(api)
class KvmemoIngress:
    def __init__(
        self,
        replicas: DeploymentHandle,
        model: str | None = None,
        *,
        chat_template: str | None = None,
        max_attempts: int = 3,
    ) -> None:
        from kvmemo.model.loading.loader import load_tokenizer

        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._replicas = replicas
        self._max_attempts = max_attempts
        tokenizer, template, _ = load_tokenizer(model)  # the tokenizer only, never the weights
        self._tokenizer = tokenizer
        self._chat_template = chat_template or template
        self._hasher: Any = None  # built from the replicas' /kv/info on the first prompt

    @api.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    # No `from __future__ import annotations` in this module: FastAPI must read these
    # annotations as objects through Ray Serve's ingress wrapper.
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        call = HTTPCall(
            method=request.method,
            path=request.url.path,
            query=request.url.query,
            headers=[(k, v) for k, v in request.headers.items() if k.lower() != "host"],
            body=body,
        )
        if request.method == "POST" and call.path in GENERATION_PATHS:
            call.block_hashes = await self._block_hashes(call)
        call.response_tag = _response_tag(call)
        return await self._send(call)

    async def _block_hashes(self, call: HTTPCall) -> tuple[bytes, ...]:
        body = call.json_body
        if not isinstance(body, dict):
            return ()  # the replica answers the error
        if self._hasher is None:
            from kvmemo.kv.hashing import BlockHash
            from kvmemo.routing.prompt_hasher import PromptHasher

            info = await self._replicas.kv_info.remote()
            self._hasher = PromptHasher(
                self._tokenizer, self._chat_template,
                BlockHash(bytes.fromhex(info["namespace_root"])), info["block_size"],
                info["hash_algorithm"],
            )
        # Tokenizing a long prompt takes milliseconds: off the loop every stream shares.
        hashes = await asyncio.to_thread(self._hasher.block_hashes, call.path, body)
        return tuple(bytes(h) for h in hashes)

    async def _send(self, call: HTTPCall) -> Response:
        for attempt in range(1, self._max_attempts + 1):
            stream: Any = self._replicas.options(stream=True).handle.remote(call)
            try:
                start = await stream.__anext__()
                first = await anext(stream, b"")
            except RayActorError as exc:  # the replica died before any byte went out
                stream.cancel()
                logger.warning("replica lost before the response started (attempt %d of %d): %s",
                               attempt, self._max_attempts, exc)
                continue
            except BaseException:  # the client went away meanwhile (cancelled): stop the replica
                stream.cancel()
                raise
            headers = {k: v for k, v in start["headers"] if k.lower() not in _DROPPED_HEADERS}
            return StreamingResponse(
                _rest(first, stream), status_code=start["status"], headers=headers,
                media_type=headers.get("content-type"),
            )
        raise APIError(
            503, f"no replica answered in {self._max_attempts} attempts", "server_error",
            code="replica_unavailable",
        )
