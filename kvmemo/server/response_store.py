"""Stored Responses-API responses: what GET /v1/responses/{id} returns and what a follow-up with
previous_response_id continues from.

Invariant: bounded in count and bytes (least recently used first out); an entry is visible only
under the cache_salt it was made with (another tenant gets a 404, as for an unknown id). With a
disk KV store, every put and delete is also written to a LineLog beside it (connector/
line_log.py), replayed at start: stored responses survive a restart, and with them the token ids
their replies were generated as (`replies`), which the intake splices back when the
conversation is rendered again (intake/reply_tokens.py), so a follow-up after a restart starts
with exactly the tokens computed before, whose KV the disk store holds.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvmemo.connector.line_log import LineLog

FILE_NAME = "responses.jsonl"
Reply = tuple[str, list[int]]  # a reply's text and the token ids it was generated as


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    conversation: list[dict[str, Any]]  # chat messages: its input history, input and output
    cache_salt: str | None
    nbytes: int
    replies: tuple[Reply, ...] = ()


class ResponseStore:
    def __init__(self, max_responses: int = 1024, max_bytes: int = 64 << 20,
                 log: LineLog | None = None) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0
        self.log = log

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            cache_salt: str | None, replies: Sequence[Reply] = ()) -> None:
        self._put(response, conversation, cache_salt, tuple(replies))
        if self.log is not None:
            self.log.append({"op": "put", "salt": cache_salt, "response": response,
                             "conversation": conversation, "replies": [list(r) for r in replies]})

    def _put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
             cache_salt: str | None, replies: tuple[Reply, ...]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        self._drop(response["id"], cache_salt)
        self._entries[response["id"]] = StoredResponse(
            response, conversation, cache_salt, size, replies)
        self.nbytes += size
        while self._entries and (len(self._entries) > self.max_responses
                                 or self.nbytes > self.max_bytes):
            _, dropped = self._entries.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def get(self, response_id: str, cache_salt: str | None) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.cache_salt != cache_salt:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, cache_salt: str | None) -> bool:
        if not self._drop(response_id, cache_salt):
            return False
        if self.log is not None:
            self.log.append({"op": "delete", "salt": cache_salt, "id": response_id})
        return True

    def _drop(self, response_id: str, cache_salt: str | None) -> bool:
        entry = self._entries.get(response_id)
        if entry is None or entry.cache_salt != cache_salt:
            return False
        del self._entries[response_id]
        self.nbytes -= entry.nbytes
        return True

    def load(self, remember_reply: Callable[[str, list[int], str | None], None]) -> int:
        """Replays the log (puts and deletes, oldest first) into the store, then hands every
        kept entry's replies to `remember_reply`; returns how many entries it holds."""
        if self.log is None:
            return 0
        for record in self.log.read():
            try:
                if record["op"] == "put":
                    replies = tuple((str(text), [int(t) for t in ids])
                                    for text, ids in record["replies"])
                    self._put(record["response"], record["conversation"], record["salt"],
                              replies)
                elif record["op"] == "delete":
                    self._drop(record["id"], record["salt"])
            except (KeyError, TypeError, ValueError):
                continue  # a record of another shape: skipped, as a damaged line is
        for entry in self._entries.values():
            for text, ids in entry.replies:
                remember_reply(text, ids, entry.cache_salt)
        return len(self._entries)
