"""ResponseStore with its LineLog: puts and deletes replayed after a restart, the replies'
token ids handed back, damage skipped, per-salt visibility kept, a full disk not fatal."""

from __future__ import annotations

from kvmemo.connector.line_log import LineLog
from kvmemo.server.response_store import ResponseStore


def _store(path) -> ResponseStore:
    return ResponseStore(log=LineLog(path / "responses.jsonl", 1 << 20, "stored responses"))


def _response(response_id: str) -> dict:
    return {"id": response_id, "object": "response", "output": []}


def test_a_restart_reads_back_puts_and_deletes(tmp_path):
    store = _store(tmp_path)
    store.put(_response("r1"), [{"role": "user", "content": "hi"}], None, [("Hello!", [5, 6])])
    store.put(_response("r2"), [{"role": "user", "content": "yo"}], "tenant", [("Yo.", [7])])
    store.put(_response("r3"), [], None)
    assert store.delete("r3", None)
    with open(store.log.path, "ab") as f:  # a torn write: skipped, not fatal
        f.write(b"0000beef {\"op\": \"put\", \n")
    remembered: list[tuple] = []
    again = _store(tmp_path)
    assert again.load(lambda text, ids, salt: remembered.append((text, ids, salt))) == 2
    assert again.get("r1", None).conversation == [{"role": "user", "content": "hi"}]
    assert again.get("r2", None) is None and again.get("r2", "tenant") is not None
    assert again.get("r3", None) is None
    assert remembered == [("Hello!", [5, 6], None), ("Yo.", [7], "tenant")]


def test_a_store_that_cannot_write_keeps_serving(tmp_path):
    store = ResponseStore(log=LineLog(tmp_path / "no" / "dir" / "r.jsonl", 1 << 20, "x"))
    store.put(_response("r1"), [], None)
    assert store.get("r1", None) is not None and store.log.paused_reason is not None
