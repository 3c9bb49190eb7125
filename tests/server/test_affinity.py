"""The router's affinity (kvmemo/routing/affinity.py) on plain replica views: a response id's tag
names its replica, prompt_cache_key sticks per cache_salt, bounded; and the replica side's tags
(server/response_store.py) persist beside a disk store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmemo.routing.affinity import Affinity
from kvmemo.server.response_store import (
    TAG_FILE_NAME,
    new_response_id,
    replica_tag,
    tag_for,
    tag_of,
)


@dataclass
class View:
    healthy: bool
    info: dict[str, Any] | None


def _replicas() -> list[View]:
    return [View(True, {"replica_id": "0a0a0a0a"}), View(True, {"replica_id": "1b1b1b1b"}),
            View(True, None)]


def test_a_response_id_names_its_replica():
    replicas, affinity = _replicas(), Affinity()
    rid = new_response_id("1b1b1b1b")
    assert tag_of(rid) == "1b1b1b1b" and affinity.holder(replicas, rid) == 1
    assert affinity.pinned(replicas, {"previous_response_id": rid}, set()) == (1, "response")
    for other in ("resp_" + "f" * 32, "resp_abc", "chatcmpl-1", None, 7):
        assert affinity.holder(replicas, other) is None
    assert affinity.pinned(replicas, {"previous_response_id": rid}, {1}) is None  # tried
    replicas[1].healthy = False
    assert affinity.pinned(replicas, {"previous_response_id": rid}, set()) is None  # down


def test_a_prompt_cache_key_follows_its_first_request_per_salt_and_is_bounded():
    replicas, affinity = _replicas(), Affinity(max_cache_keys=2)
    a = {"prompt_cache_key": "agent-a"}
    assert affinity.pinned(replicas, a, set()) is None
    affinity.note(a, 1)
    assert affinity.pinned(replicas, {**a, "input": "another"}, set()) == (1, "cache_key")
    assert affinity.pinned(replicas, {**a, "cache_salt": "tenant-2"}, set()) is None
    affinity.note({"prompt_cache_key": "b"}, 0)
    affinity.note({"prompt_cache_key": "c"}, 0)  # three keys, room for two: a is gone
    assert affinity.pinned(replicas, a, set()) is None
    assert affinity.pinned(replicas, {"prompt_cache_key": "c"}, set()) == (0, "cache_key")
    # a stored response wins over a key
    body = {"prompt_cache_key": "c", "previous_response_id": new_response_id("1b1b1b1b")}
    assert affinity.pinned(replicas, body, set()) == (1, "response")


def test_a_replica_keeps_its_tag_beside_its_store(tmp_path):
    tag = replica_tag(tmp_path)
    assert (tmp_path / TAG_FILE_NAME).read_text().strip() == tag
    assert replica_tag(tmp_path) == tag  # a restart answers for the ids it stored
    (tmp_path / TAG_FILE_NAME).write_text("not a tag\n")
    assert replica_tag(tmp_path) != "not a tag"
    assert replica_tag(None) != replica_tag(None)  # no store: new each start
    # a replica with a stable name (Ray's) gets the tag any router computes from that name
    assert tag_for("replica-7") == tag_for("replica-7") != tag_for("replica-8")
    assert tag_of(new_response_id(tag_for("replica-7"))) == tag_for("replica-7")
