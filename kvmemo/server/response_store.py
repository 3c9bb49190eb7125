"""Stored Responses-API responses: what GET /v1/responses/{id} returns and what a follow-up with
previous_response_id continues from.

Invariant: bounded in count and bytes (least recently used first out); an entry is visible only
under the cache_salt it was made with (another tenant gets a 404, as for an unknown id). With a
disk KV store, every put and delete is also written to a LineLog beside it (connector/
line_log.py), replayed at start: stored responses survive a restart, and with them the token ids
their replies were generated as (`replies`), which the intake splices back when the
conversation is rendered again (intake/reply_tokens.py), so a follow-up after a restart starts
with exactly the tokens computed before, whose KV the disk store holds.

A response id names the replica that stores it: resp_<tag><24 hex>, the tag this server reports
in GET /kv/info as replica_id, so `kvmemo router` sends a follow-up (previous_response_id) and
GET / DELETE to the one replica that can answer them. With a disk store the tag is kept beside
the log (a restarted replica answers for the ids it stored); without one it is new each start.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmemo.connector.line_log import LineLog

FILE_NAME = "responses.jsonl"
TAG_FILE_NAME = "replica_id"
_TAG = re.compile(r"[0-9a-f]{8}")
_ID = re.compile(r"resp_([0-9a-f]{8})[0-9a-f]{24}")


def replica_tag(directory: Path | None) -> str:
    """This server's tag in its response ids: read from (or first written to) `directory`, or
    new when there is none or it cannot be kept there."""
    if directory is None:
        return secrets.token_hex(4)
    path = Path(directory) / TAG_FILE_NAME
    try:
        tag = path.read_text().strip()
        if _TAG.fullmatch(tag):
            return tag
    except OSError:
        pass
    tag = secrets.token_hex(4)
    try:
        path.write_text(tag + "\n")
    except OSError:  # a read-only store: ids still route while this process runs
        pass
    return tag


def tag_for(name: str) -> str:
    """The tag of a replica that has a stable name instead of a store (a Ray Serve replica's
    id): a router that knows the name computes the tag without asking."""
    return hashlib.sha256(name.encode()).hexdigest()[:8]


def new_response_id(tag: str) -> str:
    return f"resp_{tag}{uuid.uuid4().hex[:24]}"


def tag_of(response_id: object) -> str | None:
    """The replica tag of a response id, or None for an id of another shape."""
    match = _ID.fullmatch(response_id) if isinstance(response_id, str) else None
    return match.group(1) if match else None
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
