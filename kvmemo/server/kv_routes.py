"""A replica's KV routes for routers: GET /kv/info (how to hash prompts like this replica, and
the tag its response ids carry) and GET /kv/blocks (a snapshot of the block hashes it holds, at
an event sequence number).

Invariant: a snapshot is read on the engine thread between steps, so its (epoch, seq) is exactly
the last KV event batch whose changes it includes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

if TYPE_CHECKING:
    from kvmemo.engine import AsyncEngine, Engine
    from kvmemo.server.kv_events import EventPublisher


def add_kv_routes(
    app: FastAPI, engine: AsyncEngine, publisher: EventPublisher | None, model_name: str,
    replica_id: str | None = None,
) -> None:
    """replica_id: the tag in this server's response ids (server/response_store.py)."""
    kv = engine.kv_info()
    info = {
        "model": model_name,
        "replica_id": replica_id,
        "weights_fingerprint": kv.weights_fingerprint,
        "namespace_root": bytes(kv.namespace_root).hex(),
        "block_size": kv.block_size,
        "hash_algorithm": kv.hash_algorithm,
        "kv_events_endpoint": None if publisher is None else publisher.endpoint,
    }

    @app.get("/kv/info")
    async def kv_info() -> dict[str, Any]:
        return info

    @app.get("/kv/blocks")
    async def kv_blocks() -> dict[str, Any]:
        def snapshot(e: Engine) -> tuple[str | None, int, Sequence[bytes]]:
            hashes = e.cached_block_hashes()
            if publisher is None:
                return None, 0, hashes
            return publisher.epoch, publisher.seq, hashes

        epoch, seq, hashes = await engine.call(snapshot)
        return {"epoch": epoch, "seq": seq, "block_hashes": [bytes(h).hex() for h in hashes]}
