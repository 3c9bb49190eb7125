"""Stored Responses-API responses: what GET /v1/responses/{id} returns and what a follow-up with
previous_response_id continues from.

Invariant: bounded in count and bytes (least recently used first out); an entry is visible only
under the cache_salt it was made with (another tenant gets a 404, as for an unknown id).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    conversation: list[dict[str, Any]]  # chat messages: its input history, input and output
    cache_salt: str | None
    nbytes: int


class ResponseStore:
    def __init__(self, max_responses: int = 1024, max_bytes: int = 64 << 20) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            cache_salt: str | None) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        self.delete(response["id"], cache_salt)
        self._entries[response["id"]] = StoredResponse(response, conversation, cache_salt, size)
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
        entry = self._entries.get(response_id)
        if entry is None or entry.cache_salt != cache_salt:
            return False
        del self._entries[response_id]
        self.nbytes -= entry.nbytes
        return True
