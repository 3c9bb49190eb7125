"""Requests that belong to one replica before their prompt is looked at: a Responses follow-up
(previous_response_id) and GET / DELETE of a stored response go to the replica that stored it
(its tag is in the id: server/response_store.py), and requests sharing a `prompt_cache_key`
(OpenAI's hint that prompts share a prefix) go where the key's first request went.

Invariant: the key map is bounded (least recently used out) and keyed by (cache_salt, key), so
one tenant's key never steers another's requests; a pinned replica that is down is not chosen
(the caller routes as usual, and a follow-up then gets the other replica's 404).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmemo.server.response_store import tag_of

MAX_CACHE_KEYS = 65_536


class _ReplicaView(Protocol):
    healthy: bool
    info: dict[str, Any] | None


@dataclass
class Affinity:
    max_cache_keys: int = MAX_CACHE_KEYS
    _cache_keys: OrderedDict[tuple[Any, str], int] = field(default_factory=OrderedDict)

    def holder(self, replicas: Sequence[_ReplicaView], response_id: object) -> int | None:
        """The replica whose response ids carry this id's tag (None: no such replica)."""
        tag = tag_of(response_id)
        if tag is None:
            return None
        for index, replica in enumerate(replicas):
            if replica.info is not None and replica.info.get("replica_id") == tag:
                return index
        return None

    def pinned(self, replicas: Sequence[_ReplicaView], body: dict[str, Any] | None,
               exclude: set[int]) -> tuple[int, str] | None:
        """(replica index, reason) for a request that belongs to a healthy replica."""
        if body is None:
            return None
        index = self.holder(replicas, body.get("previous_response_id"))
        reason = "response"
        key = _cache_key(body)
        if index is None and key is not None and key in self._cache_keys:
            index, reason = self._cache_keys[key], "cache_key"
            self._cache_keys.move_to_end(key)
        if index is None or index in exclude or not replicas[index].healthy:
            return None
        return index, reason

    def note(self, body: dict[str, Any] | None, index: int) -> None:
        """The request went to `index`: later ones with its prompt_cache_key follow it."""
        key = None if body is None else _cache_key(body)
        if key is None:
            return
        self._cache_keys[key] = index
        self._cache_keys.move_to_end(key)
        while len(self._cache_keys) > self.max_cache_keys:
            self._cache_keys.popitem(last=False)


def _cache_key(body: dict[str, Any]) -> tuple[Any, str] | None:
    key, salt = body.get("prompt_cache_key"), body.get("cache_salt")
    if not isinstance(key, str) or not key or not isinstance(salt, (str, type(None))):
        return None
    return (salt, key)
