"""The KV index of a Ray Serve deployment of kvmemo: which block hashes each replica holds.

One detached Ray actor per deployment. Replicas send it their KV events (kvmemo's wire format,
one batch per engine step that changed the block map); routers ask it how much of a prompt each
replica holds and tell it where they sent a prompt (a prediction, so a burst of requests with one
new prefix goes to one replica before its first BlockStored arrives).

Invariant: a replica's batches arrive in the order it sent them (Ray runs a caller's tasks on a
threaded-off, one-at-a-time actor in submission order), so each replica's index follows its
block map (kvmemo.routing.block_index.ReplicaBlockIndex, as `kvmemo router` keeps it). A replica
the index has not heard of (the index restarted) is followed from its next batch on, knowing
only what it learns from then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from kvmemo.kv.hashing import BlockHash
from kvmemo.routing.block_index import ReplicaBlockIndex
from kvmemo.server.kv_events import decode_batch

NAMESPACE = "kvmemo"


class KVIndex:
    """Owns one ReplicaBlockIndex per replica id (Ray Serve's full replica id string)."""

    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaBlockIndex] = {}

    def register(self, replica: str, epoch: str) -> None:
        """A replica starts: its pool is empty, its first batch will be seq 1 of `epoch`."""
        index = ReplicaBlockIndex()
        index.resync(epoch, 0, [])
        self._replicas[replica] = index

    def apply(self, replica: str, data: bytes) -> None:
        batch = decode_batch(data)
        index = self._replicas.get(replica)
        if index is None or index.needs_resync:
            # Unknown (the index restarted) or out of step: follow from here, from nothing.
            index = self._replicas[replica] = ReplicaBlockIndex()
            index.resync(batch.epoch, batch.seq - 1, [])
        index.apply(batch)

    def note_routed(self, replica: str, block_hashes: Sequence[bytes]) -> None:
        index = self._replicas.get(replica)
        if index is not None:
            index.note_routed(BlockHash(h) for h in block_hashes)

    def matched_blocks(self, block_hashes: Sequence[bytes], replicas: Sequence[str]) -> list[int]:
        """For each replica, the length of the longest prefix of block_hashes it holds."""
        hashes = [BlockHash(h) for h in block_hashes]
        return [
            self._replicas[r].matched_blocks(hashes) if r in self._replicas else 0
            for r in replicas
        ]

    def drop(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    def stats(self) -> dict[str, Any]:
        return {r: len(index.hashes) for r, index in self._replicas.items()}


def index_name(app_name: str, deployment_name: str) -> str:
    return f"kv_index::{app_name}::{deployment_name}"


def get_kv_index(app_name: str, deployment_name: str) -> Any:
    """The deployment's index actor, created on first use (by a replica or a router)."""
    return ray.remote(KVIndex).options(
        name=index_name(app_name, deployment_name),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_restarts=-1,
    ).remote()
