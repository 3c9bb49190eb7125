"""HTTPCall: one HTTP request carried from the Ray Serve ingress to an engine replica, and
`call_app`, which runs it through the replica's own FastAPI app (kvmemo.server.app) in process.

Invariant: the replica answers exactly as `kvmemo serve` would (same validation, errors, SSE
chunks), because the request goes through the same ASGI app; `call_app` yields the response's
start ({"status", "headers"}) once, then its body chunks as they are sent. When the caller stops
reading (the client went away, Ray cancelled the call), the app sees `http.disconnect`, so the
server code aborts the request and its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvmemo-replica"  # the replica that answered (its Ray Serve replica id)
_DISCONNECT_GRACE_S = 2.0  # for the app to abort on its own before its task is cancelled

Asgi = Callable[..., Awaitable[None]]  # an ASGI app: (scope, receive, send)


@dataclass
class HTTPCall:
    """A request as the ingress received it, plus the prompt's block hashes for routing.

    `prompt` and `messages` exist as attributes only when the JSON body has them: Ray Serve
    LLM's PrefixCacheAffinityRouter reads whichever is present, so it can route these calls too.
    """

    method: str
    path: str
    query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    block_hashes: tuple[bytes, ...] = ()  # the prompt's full blocks, as the replicas hash them
    # the tag of the replica that stores the Responses conversation this call continues or
    # reads (previous_response_id, GET / DELETE /v1/responses/{id}): it must go there
    response_tag: str | None = None

    @cached_property
    def json_body(self) -> Any:
        """The body as JSON, or None when it is not JSON."""
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None

    @property
    def prompt(self) -> Any:
        return self._field("prompt")

    @property
    def messages(self) -> Any:
        return self._field("messages")

    def _field(self, name: str) -> Any:
        body = self.json_body
        if not isinstance(body, dict) or name not in body:
            raise AttributeError(name)
        return body[name]


async def call_app(
    app: Asgi, call: HTTPCall, extra_headers: Sequence[tuple[str, str]] = ()
) -> AsyncIterator[dict[str, Any] | bytes]:
    """Run `call` through the ASGI `app`: yields {"status", "headers"}, then body chunks."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "root_path": "",
        "query_string": call.query.encode(),
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in call.headers],
        "client": None,
        "server": None,
    }
    messages: asyncio.Queue[dict | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)  # wakes the reader even when the app failed

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
                return
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1"))
                           for k, v in message.get("headers", [])]
                yield {"status": message["status"], "headers": headers + list(extra_headers)}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()  # a caller that stopped reading is a client that went away
        if not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_GRACE_S)
        if not task.done():
            task.cancel()
