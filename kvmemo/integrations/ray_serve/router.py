"""KvmemoPrefixRouter: a Ray Serve request router that sends each request to the replica holding
the longest cached prefix of its KV blocks, else to the least loaded one.

It runs wherever a handle to the engine deployment routes (the ingress). What each replica holds
comes from the deployment's KV index (kv_index.py: the replicas' KV events plus the routes taken);
the choice itself is `kvmemo router`'s policy (kvmemo.server.routing), over the requests this
router has in flight on each replica.

Invariant: only Ray's candidate replicas are ranked; a request without block hashes (not a
generation request, or a prompt the ingress could not hash) or an unreachable index goes to the
least loaded candidate.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.serve._private.common import ReplicaID
from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter

from kvmemo.integrations.ray_serve.kv_index import get_kv_index
from kvmemo.server.routing import Candidate, RoutingPolicy

logger = logging.getLogger(__name__)

INDEX_TIMEOUT_S = 0.5  # a routing decision waits no longer for the KV index


class KvmemoPrefixRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, balance_threshold: int = 4, **_: Any) -> None:
        """balance_threshold: a prefix hit goes elsewhere when its replica has this many more
        requests in flight (from this router) than the least loaded one."""
        self._policy = RoutingPolicy("prefix", balance_threshold)
        deployment = self._deployment_id
        self._index = get_kv_index(deployment.app_name, deployment.name)
        self._in_flight: dict[ReplicaID, set[str]] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = _block_hashes(pending_request)
        matched = [0] * len(candidate_replicas)
        if hashes:
            ids = [r.replica_id.to_full_id_str() for r in candidate_replicas]
            try:
                matched = await asyncio.wait_for(
                    self._index.matched_blocks.remote(hashes, ids), INDEX_TIMEOUT_S
                )
            except Exception as exc:  # the index restarts or lags: route by load meanwhile
                logger.warning("kvmemo KV index unavailable (%r); routing by load", exc)
        candidates = [
            Candidate(i, matched[i], len(self._in_flight.get(r.replica_id, ())))
            for i, r in enumerate(candidate_replicas)
        ]
        decision = self._policy.choose(candidates)
        first = candidate_replicas[decision.index]
        rest = sorted(
            (r for r in candidate_replicas if r is not first),
            key=lambda r: len(self._in_flight.get(r.replica_id, ())),
        )
        return [[first], rest] if rest else [[first]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._in_flight.setdefault(replica_id, set()).add(request_id)
        hashes = _block_hashes(pending_request)
        if hashes:  # it will hold them once it has run the prompt
            self._index.note_routed.remote(replica_id.to_full_id_str(), hashes)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.get(replica_id, set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id, None)
        self._index.drop.remote(replica_id.to_full_id_str())


def _block_hashes(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    return tuple(getattr(pending_request.args[0], "block_hashes", ()) or ())
