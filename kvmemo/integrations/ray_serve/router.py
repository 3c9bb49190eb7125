"""KvmemoPrefixRouter: a Ray Serve request router that sends each request to the replica holding
the longest cached prefix of its KV blocks, else to the least loaded one.

It runs wherever a handle to the engine deployment routes (the ingress). What each replica holds
comes from the deployment's KV index (kv_index.py: the replicas' KV events plus the routes taken);
the choice itself is `kvmemo router`'s policy (kvmemo.routing.policy), over the requests this
router has in flight on each replica.

Invariant: only Ray's candidate replicas are ranked; a request without block hashes (not a
generation request, or a prompt the ingress could not hash) goes to the least loaded candidate.
A call that continues or reads a stored Responses conversation goes first to the replica whose
id gives the response id's tag (server/response_store.py, tag_for).
When the index does not answer in time (it lags behind replicas' events when the CPUs are busy
prefilling), the router ranks by the routes it took itself: a prefix it sent to a replica
still goes there.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from ray.serve._private.common import ReplicaID
from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter

from kvmemo.integrations.ray_serve.kv_index import get_kv_index
from kvmemo.routing.policy import Candidate, RoutingPolicy
from kvmemo.server.response_store import tag_for

logger = logging.getLogger(__name__)

INDEX_TIMEOUT_S = 0.5  # a routing decision waits no longer for the KV index
_ROUTED_BLOCKS_KEPT = 200_000  # block hashes this router remembers routing (LRU; ~10 MB)


class KvmemoPrefixRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, balance_threshold: int = 4, **_: Any) -> None:
        """balance_threshold: a prefix hit goes elsewhere when its replica has this many more
        requests in flight (from this router) than the least loaded one."""
        self._policy = RoutingPolicy("prefix", balance_threshold)
        deployment = self._deployment_id
        self._index = get_kv_index(deployment.app_name, deployment.name)
        self._in_flight: dict[ReplicaID, set[str]] = {}
        # block hash -> the replica this router last sent a prompt holding it to
        self._routed: OrderedDict[bytes, ReplicaID] = OrderedDict()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        tag = _response_tag(pending_request)
        holders = [r for r in candidate_replicas
                   if tag is not None and tag_for(r.replica_id.to_full_id_str()) == tag]
        if holders:  # a stored Responses conversation: only its replica can continue it
            rest = [r for r in candidate_replicas if r is not holders[0]]
            return [[holders[0]], rest] if rest else [[holders[0]]]
        hashes = _block_hashes(pending_request)
        matched = [0] * len(candidate_replicas)
        if hashes:
            ids = [r.replica_id.to_full_id_str() for r in candidate_replicas]
            try:
                matched = await asyncio.wait_for(
                    self._index.matched_blocks.remote(hashes, ids), INDEX_TIMEOUT_S
                )
            except Exception as exc:  # the index restarts or lags: our own routes meanwhile
                logger.warning("kvmemo KV index unavailable (%r); routing by own routes", exc)
                matched = [self._routed_prefix(hashes, r.replica_id) for r in candidate_replicas]
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
            for block_hash in hashes:
                self._routed[block_hash] = replica_id
                self._routed.move_to_end(block_hash)
            while len(self._routed) > _ROUTED_BLOCKS_KEPT:
                self._routed.popitem(last=False)

    def _routed_prefix(self, hashes: tuple[bytes, ...], replica_id: ReplicaID) -> int:
        """Leading blocks of `hashes` this router last sent to `replica_id`."""
        count = 0
        for block_hash in hashes:
            if self._routed.get(block_hash) != replica_id:
                break
            count += 1
        return count

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.get(replica_id, set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id, None)
        self._index.drop.remote(replica_id.to_full_id_str())
        for block_hash in [h for h, r in self._routed.items() if r == replica_id]:
            del self._routed[block_hash]


def _response_tag(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "response_tag", None)


def _block_hashes(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    return tuple(getattr(pending_request.args[0], "block_hashes", ()) or ())
