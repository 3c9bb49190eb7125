"""KvmemoReplica: one kvmemo engine as a Ray Serve replica, answering through the server's app.

Invariant: a replica is `kvmemo serve` without the socket. It builds the same Engine, AsyncEngine
and FastAPI app (kvmemo.server.app.create_app), and each HTTPCall from the ingress runs through
that app (http_call.call_app), so requests and responses are the server's own. Every engine step
that changes the block map sends its KV events to the deployment's KV index, where the prefix
router reads them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvmemo.integrations.ray_serve.http_call import REPLICA_HEADER, HTTPCall, call_app
from kvmemo.kv.events import KVEvent

logger = logging.getLogger(__name__)


class KvmemoReplica:
    """Ray Serve deployment class (wrapped by serve.deployment in app.build_app)."""

    def __init__(
        self,
        model: str | None,
        *,
        engine_options: dict[str, Any] | None = None,
        served_model_name: str | None = None,
        api_key: str | None = None,
        max_waiting: int = 256,
        num_threads: int | None = None,
    ) -> None:
        import torch
        from ray import serve

        from kvmemo.config import EngineConfig
        from kvmemo.engine import AsyncEngine, Engine
        from kvmemo.integrations.ray_serve.kv_index import get_kv_index
        from kvmemo.server.app import create_app
        from kvmemo.server.response_store import tag_for
        from kvmemo.server.serve import default_model_name

        if num_threads:  # the cores Ray gave this replica, not the whole machine's
            torch.set_num_threads(num_threads)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.to_full_id_str()
        options = dict(engine_options or {})
        options["enable_kv_events"] = True
        inner = Engine(EngineConfig.from_kwargs(model=model, **options))
        self._index = get_kv_index(context.app_name, context.deployment)
        self._epoch = uuid.uuid4().hex[:16]
        self._seq = 0
        import ray

        ray.get(self._index.register.remote(self.replica_id, self._epoch))
        inner.subscribe_kv_events(self._send_events)  # before the engine thread starts
        self.engine = AsyncEngine(inner, max_waiting=max_waiting)
        name = served_model_name or default_model_name(model)
        # Response ids carry a tag the prefix router computes from this replica's id, so a
        # Responses follow-up comes back here (router.py).
        self._app = create_app(self.engine, model_name=name, api_key=api_key,
                               replica_tag=tag_for(self.replica_id))
        self._headers = [(REPLICA_HEADER, self.replica_id)]
        logger.info("kvmemo replica %s ready (%s)", self.replica_id, name)

    def _send_events(self, events: Sequence[KVEvent]) -> None:
        """On the engine thread after a step: one batch to the KV index, not waited for."""
        from kvmemo.server.kv_events import EventBatch, encode_batch

        self._seq += 1
        batch = EventBatch(self._epoch, self._seq, time.time(), tuple(events))
        try:
            self._index.apply.remote(self.replica_id, encode_batch(batch))
        except Exception as exc:  # routing loses precision; serving must not stop
            logger.warning("KV events batch %d not sent to the index: %r", self._seq, exc)

    async def handle(self, call: HTTPCall) -> AsyncIterator[dict[str, Any] | bytes]:
        """The response to one HTTP request: {"status", "headers"}, then body chunks."""
        async for item in call_app(self._app, call, self._headers):
            yield item

    async def kv_info(self) -> dict[str, Any]:
        """How this replica names its blocks (the ingress hashes prompts the same way)."""
        kv = self.engine.kv_info()
        return {
            "namespace_root": bytes(kv.namespace_root).hex(),
            "block_size": kv.block_size,
            "hash_algorithm": kv.hash_algorithm,
        }

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine thread makes Ray replace the replica."""
        if not self.engine.is_alive:
            raise RuntimeError("the kvmemo engine is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        index = getattr(self, "_index", None)
        if index is not None:  # scaled down or redeployed: its blocks attract no more prompts
            try:
                index.drop.remote(self.replica_id)
            except Exception:  # Ray shutting down
                pass
