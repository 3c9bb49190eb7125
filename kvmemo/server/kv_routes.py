"""A replica's KV routes for routers: GET /kv/info (how to hash prompts like this replica) and
GET /kv/blocks (a snapshot of the block hashes it holds, at an event sequence number).

Invariant: a snapshot is read on the engine thread between steps, so its (epoch, seq) is exactly
the last KV event batch whose changes it includes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

if TYPE_CHECKING:
    from kvmemo.engine.async_engine import AsyncEngine
    from kvmemo.server.kv_events import KVEventPublisher


def add_kv_routes(
    app: FastAPI, engine: AsyncEngine, publisher: KVEventPublisher | None, model_name: str
) -> None:
    inner = engine.engine
    hasher = inner.hasher
    info = {
        "model": model_name,
        "weights_fingerprint": inner.loaded.weights_fingerprint,
        "namespace_root": bytes(hasher.root).hex(),
        "block_size": hasher.block_size,
        "hash_algorithm": hasher.algorithm,
        "kv_events_endpoint": None if publisher is None else publisher.endpoint,
    }

    @app.get("/kv/info")
    async def kv_info() -> dict[str, Any]:
        return info

    @app.get("/kv/blocks")
    async def kv_blocks() -> dict[str, Any]:
        def snapshot(e) -> tuple[str | None, int, list[bytes]]:
            hashes = e.kv_manager.block_pool.cached_block_hashes()
            if publisher is None:
                return None, 0, hashes
            return publisher.epoch, publisher.seq, hashes

        epoch, seq, hashes = await engine.call(snapshot)
        return {"epoch": epoch, "seq": seq, "block_hashes": [bytes(h).hex() for h in hashes]}
