"""A Responses stream's output items, as the reply's events come (tool_calls/stream.py): a
`message` item for its text, then a `function_call` item per call, each opened, filled and
closed with the Responses event types.

Invariant: an item streamed here keeps its id in the final response (the message's is given,
a function call's comes from its call id: function_call_item), so the events and the
response.completed that ends them name the same items.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvmemo.tool_calls.stream import ArgumentsDelta, CallStarted, StreamEvent, TextDelta


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"),
            "call_id": call_id, "name": name, "arguments": arguments, "status": status}


@dataclass
class OutputItems:
    event: Callable[..., str]
    message_id: str
    index: int = 0  # output_index of the open or next item
    text: str | None = None  # the open message's text so far (None: no message open)
    call: dict[str, Any] | None = None  # the open function call's item
    done: set[str] = field(default_factory=set)  # ids of the items closed here

    def lines(self, events: list[StreamEvent], finish_reason: str | None) -> Iterator[str]:
        status = "incomplete" if finish_reason == "length" else "completed"
        for e in events:
            if isinstance(e, TextDelta):
                if self.text is None:
                    self.text = ""
                    yield from self._open_message()
                self.text += e.text
                yield self.event("response.output_text.delta", item_id=self.message_id,
                                 output_index=self.index, content_index=0, delta=e.text,
                                 logprobs=[])
            elif isinstance(e, CallStarted):
                yield from self.close_message(self.text or "")
                self.call = function_call_item(e.call.id, e.call.name, "", "in_progress")
                yield self.event("response.output_item.added", output_index=self.index,
                                 item=self.call)
            elif isinstance(e, ArgumentsDelta) and self.call is not None:
                self.call["arguments"] += e.text
                yield self.event("response.function_call_arguments.delta",
                                 item_id=self.call["id"], output_index=self.index, delta=e.text)
            elif self.call is not None:  # CallEnded
                yield from self._close_call(self.call, status)

    def finish(self, output: list[dict[str, Any]]) -> Iterator[str]:
        """Close what is open and send, whole, the final items not streamed."""
        for item in output:
            if item["id"] in self.done:
                continue
            if item["type"] == "message":
                text = item["content"][0]["text"]
                if self.text is None or item["id"] != self.message_id:  # not streamed
                    yield from self.close_message(self.text or "")
                    self.text, self.message_id = "", item["id"]
                    yield from self._open_message()
                    yield self.event("response.output_text.delta", item_id=item["id"],
                                     output_index=self.index, content_index=0, delta=text,
                                     logprobs=[])
                yield from self.close_message(text, item["status"])
            else:
                yield self.event("response.output_item.added", output_index=self.index,
                                 item={**item, "arguments": "", "status": "in_progress"})
                yield self.event("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=self.index, delta=item["arguments"])
                yield from self._close_call(item, item["status"])

    def _open_message(self) -> Iterator[str]:
        yield self.event("response.output_item.added", output_index=self.index, item={
            "type": "message", "id": self.message_id, "status": "in_progress",
            "role": "assistant", "content": []})
        yield self.event("response.content_part.added", item_id=self.message_id,
                         output_index=self.index, content_index=0, part=text_part(""))

    def close_message(self, text: str, status: str = "completed") -> Iterator[str]:
        if self.text is None:
            return
        part = text_part(text)
        yield self.event("response.output_text.done", item_id=self.message_id,
                         output_index=self.index, content_index=0, text=text, logprobs=[])
        yield self.event("response.content_part.done", item_id=self.message_id,
                         output_index=self.index, content_index=0, part=part)
        yield self.event("response.output_item.done", output_index=self.index, item={
            "type": "message", "id": self.message_id, "status": status, "role": "assistant",
            "content": [part]})
        self.done.add(self.message_id)
        self.text = None
        self.index += 1

    def _close_call(self, item: dict[str, Any], status: str) -> Iterator[str]:
        item = {**item, "status": status}
        yield self.event("response.function_call_arguments.done", item_id=item["id"],
                         output_index=self.index, arguments=item["arguments"],
                         name=item["name"])
        yield self.event("response.output_item.done", output_index=self.index, item=item)
        self.done.add(item["id"])
        self.call = None
        self.index += 1
