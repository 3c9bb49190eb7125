"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens.

A Messages request is translated into the chat route's request (anthropic_protocol.py) and runs
through the chat route's whole path (intake, tools, the engine, tool-call parsing); only the
answer is Anthropic's: a `message` with text and tool_use content blocks, or its event stream
(message_start, content_block_start/delta/stop, ping, message_delta, message_stop).

Retention: each cache_control breakpoint keeps the prompt's prefix up to its block cached for its
ttl after the request (kv/retention.py). The prefix's length in tokens is how far the request cut
just after the marked block renders the same tokens as the whole request (a cut the template
refuses keeps the whole prompt). A request whose breakpoints would take its cache_salt past
--max-retained-tokens gets a 400 naming the limit.

Invariant: usage adds up as Anthropic's does: input_tokens + cache_read_input_tokens +
cache_creation_input_tokens = the prompt's tokens. cache_read_input_tokens are the prompt tokens
whose KV came from the cache (any prefix, marked or not: kvmemo caches every full block);
cache_creation_input_tokens, when the request has a cache_control breakpoint, are the prompt's
tokens in full blocks that were computed now (what the next request can read), else 0. A
streamed reply with tools sends its text and each tool_use block as they are generated
(tool_calls/stream.py): a block starts when its call's arguments open.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kvmemo.engine import EngineDeadError
from kvmemo.kv.retention import Retention
from kvmemo.server.anthropic_protocol import (
    TTL_SECONDS,
    CacheBreakpoints,
    CountTokensRequest,
    MessagesRequest,
    breakpoints,
    chat_request,
)
from kvmemo.server.job import Choice, Job
from kvmemo.server.protocol import ChatCompletionRequest, CompletionRequest
from kvmemo.server.serving_chat import ServingChat
from kvmemo.server.token_routes import chat_token_ids, chat_token_ids_each
from kvmemo.tool_calls.stream import ArgumentsDelta, CallStarted, StreamEvent, TextDelta


class ServingMessages(ServingChat):
    object_name = "message"
    chunk_object_name = "message"
    id_prefix = ""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # request id -> its cache_control breakpoint count, until its answer is built
        self._marks: dict[str, int] = {}
        self._retention: dict[str, tuple[Retention, ...]] = {}  # request id -> until queued

    def _marks_of(self, job: Job) -> int:
        return self._marks.get(job.name or "", 0)

    async def create_message(self, body: MessagesRequest, request: Request) -> Response:
        marks = breakpoints(body)
        chat = chat_request(body)
        chat.request_id = "msg_" + uuid.uuid4().hex[:24]
        self._marks[chat.request_id] = marks.count
        if marks.prefixes:
            self._retention[chat.request_id] = await self._breakpoint_retention(chat, marks)
        try:
            return await self.create(chat, request)
        finally:
            self._retention.pop(chat.request_id, None)
            if not body.stream:  # a stream's events still need it: dropped when it ends
                self._marks.pop(chat.request_id, None)

    async def _breakpoint_retention(
        self, chat: ChatCompletionRequest, marks: CacheBreakpoints
    ) -> tuple[Retention, ...]:
        cuts: list[ChatCompletionRequest | None] = [chat]
        for cut, _ in marks.prefixes:
            try:
                cuts.append(None if cut is None else chat_request(cut))
            except ValueError:  # e.g. a tool_choice naming a tool past the cut
                cuts.append(None)
        whole, *parts = await chat_token_ids_each(self.engine, cuts)
        if whole is None:
            return ()  # the request itself does not render: create() reports why
        ranges = []
        for ids, (_, ttl) in zip(parts, marks.prefixes):
            num_tokens = len(whole) if ids is None else _common_prefix(ids, whole)
            ranges.append(Retention(num_tokens, TTL_SECONDS[ttl]))
        return tuple(ranges)

    def retention_of(
        self, body: CompletionRequest | ChatCompletionRequest
    ) -> tuple[Retention, ...]:
        return self._retention.pop(body.request_id or "", ())

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        breakpoints(body)
        chat = chat_request(body)
        return {"input_tokens": len(await chat_token_ids(self.engine, chat))}

    # ---- the answer ------------------------------------------------------------------------

    def usage_json(self, job: Job) -> dict[str, int]:
        prompt, cached = job.num_prompt_tokens, job.num_cached_tokens
        created = 0
        if self._marks_of(job):
            block = self.engine.kv_info().block_size
            created = max(0, prompt // block * block - cached)
        return {"input_tokens": prompt - cached - created, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": created,
                "output_tokens": sum(c.num_tokens for c in job.choices)}

    def content_blocks(self, job: Job, choice: Choice) -> list[dict[str, Any]]:
        message = self.choice_fields(job, choice)["message"]
        blocks: list[dict[str, Any]] = []
        if message.get("content"):
            blocks.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            blocks.append({"type": "tool_use", "id": call["id"],
                           "name": call["function"]["name"],
                           "input": json.loads(call["function"]["arguments"] or "{}")})
        return blocks

    def stop_fields(self, job: Job, choice: Choice) -> dict[str, Any]:
        reason = self.finish_reason(job, choice)
        if reason == "tool_calls":
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if isinstance(choice.stop_reason, str):
            return {"stop_reason": "stop_sequence", "stop_sequence": choice.stop_reason}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def message_json(self, job: Job, content: list[dict[str, Any]],
                     stop: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.response_id(job), "type": "message", "role": "assistant",
                "model": self.model_name, "content": content, **stop,
                "usage": self.usage_json(job)}

    def full_response(self, job: Job) -> dict[str, Any]:
        choice = job.choices[0]
        return self.message_json(job, self.content_blocks(job, choice),
                                 self.stop_fields(job, choice))

    async def stream_events(
        self, job: Job, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[str]:
        def event(kind: str, **data: Any) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        choice = job.choices[0]
        started = False
        blocks = _ContentBlocks(event)
        try:
            async for item in job.stream:
                _, delta = job.update(item)
                if not started:
                    started = True
                    opening = self.message_json(job, [], {"stop_reason": None,
                                                          "stop_sequence": None})
                    opening["usage"]["output_tokens"] = 0
                    yield event("message_start", message=opening)
                    yield event("ping")
                if job.tool_replies is not None:  # text and calls as they are read
                    events = job.tool_replies.stream(0, delta, choice.finish_reason)
                else:
                    events = [TextDelta(delta)] if delta else []
                for line in blocks.lines(events):
                    yield line
            for line in blocks.close():
                yield line
            usage = self.usage_json(job)
            yield event("message_delta", delta=self.stop_fields(job, choice),
                        usage={"output_tokens": usage["output_tokens"]})
            yield event("message_stop")
        except EngineDeadError as e:
            yield event("error", error={"type": "api_error", "message": str(e)})
        finally:
            job.stream.abort()
            self.record(job)
            self._marks.pop(job.name or "", None)


@dataclass
class _ContentBlocks:
    """A streamed message's content blocks, opened and closed as the reply's events come: a
    text block, then a tool_use block per call (its input as input_json_delta fragments)."""

    event: Callable[..., str]
    index: int = 0  # of the open or next block
    open: str | None = None  # the open block's type

    def lines(self, events: list[StreamEvent]) -> Iterator[str]:
        for e in events:
            if isinstance(e, TextDelta):
                if self.open != "text":
                    yield from self.close()
                    yield self._start({"type": "text", "text": ""})
                yield self.event("content_block_delta", index=self.index,
                                 delta={"type": "text_delta", "text": e.text})
            elif isinstance(e, CallStarted):
                yield from self.close()
                yield self._start({"type": "tool_use", "id": e.call.id, "name": e.call.name,
                                   "input": {}})
            elif isinstance(e, ArgumentsDelta):
                yield self.event("content_block_delta", index=self.index,
                                 delta={"type": "input_json_delta", "partial_json": e.text})
            else:  # CallEnded
                yield from self.close()

    def _start(self, block: dict[str, Any]) -> str:
        self.open = block["type"]
        return self.event("content_block_start", index=self.index, content_block=block)

    def close(self) -> Iterator[str]:
        if self.open is not None:
            yield self.event("content_block_stop", index=self.index)
            self.index += 1
            self.open = None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
