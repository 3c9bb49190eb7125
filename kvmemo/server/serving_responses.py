"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A Responses request is translated into the chat route's request (responses_protocol.py) and runs
through the chat route's whole path; the answer is a `response` object with `message` and
`function_call` output items, or its event stream (response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta / .done,
response.content_part.done, response.function_call_arguments.delta / .done,
response.output_item.done, response.completed), each event numbered.

Invariant: with store (the default) the response and its conversation (earlier turns, this input
and this output, as chat messages) are kept (response_store.py), so a follow-up naming it as
previous_response_id renders the same conversation again: its prompt starts with the tokens the
last turn computed, which the prefix cache holds. A streamed reply sends its message and each
function call as they are generated (responses_stream.py). prompt_cache_retention "24h" and
prompt_cache_options.ttl keep the whole prompt cached for that long (kv/retention.py).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kvmemo.connector.line_log import LineLog
from kvmemo.engine import EngineDeadError
from kvmemo.kv.retention import Retention
from kvmemo.server.errors import APIError
from kvmemo.server.job import Job
from kvmemo.server.protocol import ChatCompletionRequest, CompletionRequest
from kvmemo.server.response_store import (
    FILE_NAME,
    ResponseStore,
    new_response_id,
)
from kvmemo.server.response_store import replica_tag as store_tag
from kvmemo.server.responses_protocol import (
    ResponsesRequest,
    chat_request,
    input_messages,
    retention,
)
from kvmemo.server.responses_stream import OutputItems, function_call_item, text_part
from kvmemo.server.serving_chat import ServingChat
from kvmemo.tool_calls.stream import TextDelta

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    body: ResponsesRequest
    conversation: list[dict[str, Any]]  # history and this input, as chat messages


class ServingResponses(ServingChat):
    object_name = "response"
    chunk_object_name = "response"
    id_prefix = ""

    def __init__(self, *args: Any, replica_tag: str | None = None) -> None:
        """replica_tag: the tag in this server's response ids; by default kept beside the
        disk store (response_store.replica_tag)."""
        super().__init__(*args)
        directory = self.engine.disk_store_dir
        log = None if directory is None else LineLog(
            directory / FILE_NAME, 128 << 20, "stored responses")
        self.store = ResponseStore(log=log)
        # in every response id (response_store.py)
        self.replica_tag = replica_tag if replica_tag is not None else store_tag(directory)
        loaded = self.store.load(self.engine.reply_tokens.remember)
        if loaded:
            logger.info("stored responses: %d read back from %s", loaded, log and log.path)
        self._pending: dict[str, _Pending] = {}  # request id -> its request, until answered

    async def create_response(self, body: ResponsesRequest, request: Request) -> Response:
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id, body.cache_salt)
            if stored is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            history = stored.conversation
        retention(body)  # its 400s, before anything is queued
        chat = chat_request(body, history)
        chat.request_id = new_response_id(self.replica_tag)
        self._pending[chat.request_id] = _Pending(body, history + input_messages(body.input))
        try:
            return await self.create(chat, request)
        finally:
            if not body.stream:  # a stream's events still need it: dropped when it ends
                self._pending.pop(chat.request_id, None)

    def retention_of(
        self, body: CompletionRequest | ChatCompletionRequest
    ) -> tuple[Retention, ...]:
        pending = self._pending.get(body.request_id or "")
        return () if pending is None else retention(pending.body)

    def retrieve(self, response_id: str, cache_salt: str | None) -> dict[str, Any]:
        stored = self.store.get(response_id, cache_salt)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return stored.response

    def delete(self, response_id: str, cache_salt: str | None) -> dict[str, Any]:
        if not self.store.delete(response_id, cache_salt):
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # ---- the answer ------------------------------------------------------------------------

    def response_json(self, job: Job, output: list[dict[str, Any]], final: bool
                      ) -> dict[str, Any]:
        body = self._pending[job.name or ""].body
        cut = final and job.choices[0].finish_reason == "length"
        status = ("incomplete" if cut else "completed") if final else "in_progress"
        out_tokens = sum(c.num_tokens for c in job.choices)
        return {
            "id": self.response_id(job), "object": "response", "created_at": job.created,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.model_name, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "truncation": body.truncation or "disabled", "metadata": body.metadata or {},
            "usage": {
                "input_tokens": job.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": job.num_cached_tokens,
                                         **job.miss_details},
                "output_tokens": out_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": job.num_prompt_tokens + out_tokens,
            },
        }

    def output_items(self, job: Job, message_id: str | None = None
                     ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The finished reply as output items (its message item named message_id, as its
        stream did), and as the chat message the conversation keeps."""
        choice = job.choices[0]
        message = self.choice_fields(job, choice)["message"]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        items: list[dict[str, Any]] = []
        if message.get("content"):
            items.append({"type": "message", "id": message_id or f"msg_{uuid.uuid4().hex[:24]}",
                          "status": status, "role": "assistant",
                          "content": [text_part(message["content"])]})
        for call in message.get("tool_calls") or ():
            function = call["function"]
            items.append(function_call_item(call["id"], function["name"], function["arguments"],
                                            status))
        return items, message

    def finished(self, job: Job, message_id: str | None = None) -> dict[str, Any]:
        """The final response object (stored when the request asked for it)."""
        items, message = self.output_items(job, message_id)
        response = self.response_json(job, items, final=True)
        pending = self._pending[job.name or ""]
        if pending.body.store:
            salt, text = pending.body.cache_salt, message.get("content")
            ids = self.engine.reply_tokens.get(text, salt) if isinstance(text, str) else None
            earlier = self.store.get(pending.body.previous_response_id or "", salt)
            replies = list(earlier.replies) if earlier else []  # the conversation's replies
            if ids is not None and isinstance(text, str):
                replies.append((text, list(ids)))
            self.store.put(response, pending.conversation + [message], salt, replies)
        return response

    def full_response(self, job: Job) -> dict[str, Any]:
        return self.finished(job)

    async def stream_events(
        self, job: Job, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[str]:
        numbers = iter(range(1 << 62))

        def event(kind: str, **data: Any) -> str:
            payload = {"type": kind, "sequence_number": next(numbers), **data}
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

        started = False
        choice = job.choices[0]
        items = OutputItems(event, f"msg_{uuid.uuid4().hex[:24]}")
        try:
            async for item in job.stream:
                _, delta = job.update(item)
                if not started:
                    started = True
                    opening = self.response_json(job, [], final=False)
                    yield event("response.created", response=opening)
                    yield event("response.in_progress", response=opening)
                if job.tool_replies is not None:  # text and calls as they are read
                    events = job.tool_replies.stream(0, delta, choice.finish_reason)
                else:
                    events = [TextDelta(delta)] if delta else []
                for line in items.lines(events, choice.finish_reason):
                    yield line
            final = self.finished(job, message_id=items.message_id)
            for line in items.finish(final["output"]):
                yield line
            yield event("response.completed", response=final)
        except EngineDeadError as e:
            yield event("error", code="engine_unavailable", message=str(e), param=None)
        finally:
            job.stream.abort()
            self.record(job)
            self._pending.pop(job.name or "", None)


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r} (under this cache_salt)",
                    "invalid_request_error", param=param, code="response_not_found")
