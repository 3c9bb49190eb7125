"""The Ray Serve integration's parts without a cluster: the in-process ASGI call and the KV index."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402

from kvmemo.integrations.ray_serve.http_call import HTTPCall, call_app  # noqa: E402
from kvmemo.integrations.ray_serve.kv_index import KVIndex  # noqa: E402
from kvmemo.kv.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from kvmemo.server.kv_events import EventBatch, encode_batch  # noqa: E402


def _collect(app, call: HTTPCall, limit: int | None = None) -> list:
    async def run():
        items = []
        gen = call_app(app, call, [("x-extra", "1")])
        async for item in gen:
            items.append(item)
            if limit is not None and len(items) >= limit:
                await gen.aclose()
                break
        return items

    return asyncio.run(run())


def test_call_app_returns_the_apps_status_headers_and_body():
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.json()
        return {"got": body, "q": request.url.query, "auth": request.headers.get("authorization")}

    call = HTTPCall("POST", "/echo", "a=1", [("Authorization", "Bearer k")], b'{"x": 2}')
    start, *chunks = _collect(app, call)
    assert start["status"] == 200
    assert ("x-extra", "1") in start["headers"]
    assert ("content-type", "application/json") in start["headers"]
    assert json.loads(b"".join(chunks)) == {"got": {"x": 2}, "q": "a=1", "auth": "Bearer k"}


def test_call_app_passes_errors_through_as_responses():
    app = FastAPI()

    @app.get("/missing")
    async def missing():
        from fastapi import HTTPException

        raise HTTPException(404, "nope")

    start, *chunks = _collect(app, HTTPCall("GET", "/missing"))
    assert start["status"] == 404
    assert json.loads(b"".join(chunks)) == {"detail": "nope"}


def test_a_caller_that_stops_reading_is_a_client_that_went_away():
    """The app's stream sees http.disconnect and stops (the server aborts the request there)."""
    app = FastAPI()
    seen: list[str] = []

    @app.get("/stream")
    async def stream(request: Request):
        async def body():
            try:
                for i in range(1000):
                    if await request.is_disconnected():
                        seen.append("disconnected")
                        return
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
                seen.append("finished")
            finally:
                seen.append("closed")

        return StreamingResponse(body(), media_type="text/event-stream")

    items = _collect(app, HTTPCall("GET", "/stream"), limit=3)
    assert items[0]["status"] == 200 and items[1] == b"data: 0\n\n"
    assert "finished" not in seen and "closed" in seen


def test_http_call_exposes_prompt_or_messages_only_when_the_body_has_them():
    """Ray Serve LLM's PrefixCacheAffinityRouter routes on whichever attribute exists."""
    chat = HTTPCall("POST", "/v1/chat/completions", body=b'{"messages": [{"role": "user"}]}')
    assert hasattr(chat, "messages") and not hasattr(chat, "prompt")
    completion = HTTPCall("POST", "/v1/completions", body=b'{"prompt": "hi"}')
    assert completion.prompt == "hi" and not hasattr(completion, "messages")
    assert not hasattr(HTTPCall("POST", "/x", body=b"not json"), "prompt")


def test_a_call_on_a_stored_response_names_its_replicas_tag():
    from kvmemo.integrations.ray_serve.ingress import _response_tag
    from kvmemo.server.response_store import new_response_id, tag_for

    tag = tag_for("SERVE_REPLICA::kvmemo#KvmemoReplica#abc")
    rid = new_response_id(tag)
    follow_up = json.dumps({"input": "hi", "previous_response_id": rid}).encode()
    assert _response_tag(HTTPCall("POST", "/v1/responses", body=follow_up)) == tag
    assert _response_tag(HTTPCall("GET", f"/v1/responses/{rid}")) == tag
    assert _response_tag(HTTPCall("DELETE", f"/v1/responses/{rid}")) == tag
    assert _response_tag(HTTPCall("POST", "/v1/responses", body=b'{"input": "hi"}')) is None
    assert _response_tag(HTTPCall("POST", "/v1/chat/completions", body=follow_up)) is None
    assert _response_tag(HTTPCall("GET", "/v1/responses/resp_not-an-id")) is None


def _h(i: int) -> bytes:
    return bytes([i]) * 8


def _stored(*ids: int) -> BlockStored:
    return BlockStored(tuple(_h(i) for i in ids), None, tuple(range(16 * len(ids))), 16, ())


def test_kv_index_follows_each_replicas_events_and_predictions():
    index = KVIndex()
    index.register("a", "ea")
    index.register("b", "eb")
    index.apply("a", encode_batch(EventBatch("ea", 1, 0.0, (_stored(1, 2, 3),))))
    index.apply("b", encode_batch(EventBatch("eb", 1, 0.0, (_stored(1),))))
    prompt = [_h(1), _h(2), _h(3), _h(4)]
    assert index.matched_blocks(prompt, ["a", "b", "unknown"]) == [3, 1, 0]
    index.apply("a", encode_batch(EventBatch("ea", 2, 0.0, (BlockRemoved((_h(2),)),))))
    assert index.matched_blocks(prompt, ["a"]) == [1]
    index.note_routed("b", prompt)  # routed there: predicted until its events say otherwise
    assert index.matched_blocks(prompt, ["b"]) == [4]
    index.apply("b", encode_batch(EventBatch("eb", 2, 0.0, (AllBlocksCleared(),))))
    assert index.matched_blocks(prompt, ["b"]) == [0]
    index.drop("a")
    assert index.matched_blocks(prompt, ["a"]) == [0]


def test_kv_index_follows_a_replica_it_never_registered_from_its_next_batch():
    """After the index actor restarts it knows no replica: it learns from the next batch on."""
    index = KVIndex()
    index.apply("a", encode_batch(EventBatch("ea", 7, 0.0, (_stored(5),))))
    assert index.matched_blocks([_h(5)], ["a"]) == [1]
    index.apply("a", encode_batch(EventBatch("ea", 8, 0.0, (_stored(6),))))
    assert index.stats() == {"a": 2}


def test_bad_application_settings_are_refused_with_what_is_allowed():
    from kvmemo.cli import main
    from kvmemo.integrations.ray_serve import Autoscaling
    from kvmemo.integrations.ray_serve.app import request_router_config

    with pytest.raises(ValueError, match=r"router must be one of \['kvmemo', 'prefix_affinity', 'pow2'\]"):
        request_router_config("random")
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        Autoscaling(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="target_ongoing_requests must be > 0"):
        Autoscaling(target_ongoing_requests=0)
    assert request_router_config("pow2") is None  # Ray's default router
    assert main(["ray-serve", "--min-replicas", "1"]) == 2  # both bounds or neither
