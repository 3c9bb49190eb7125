"""KV events on the wire: msgpack batches with a sequence number, published over ZeroMQ PUB.

Invariant: one message per engine step that changed the block map, seq = previous seq + 1 (from
1, per publisher epoch), events in the order the pool changed its map; a subscriber that sees any
other seq has missed something and must resync from the replica's snapshot (GET /kv/blocks).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import zmq

from kvmemo.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmemo.kv.hashing import BlockHash

logger = logging.getLogger(__name__)

TOPIC = b"kvmemo.kv_events"
WIRE_VERSION = 1


@dataclass(frozen=True)
class EventBatch:
    """One message: the events of one engine step."""

    epoch: str  # the publisher's random id: a restarted replica starts a new epoch at seq 1
    seq: int
    timestamp: float  # time.time() at publication
    events: tuple[KVEvent, ...]


def stored_fields(event: BlockStored) -> dict[str, Any]:
    """The fields of a BlockStored that kvmemo's and vLLM's wire formats share, as msgpack
    takes them (hashes as bytes)."""
    return {
        "type": "BlockStored",
        "block_hashes": [bytes(h) for h in event.block_hashes],
        "parent_block_hash": None
        if event.parent_block_hash is None
        else bytes(event.parent_block_hash),
        "token_ids": list(event.token_ids),
        "block_size": event.block_size,
    }


def _event_to_wire(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            **stored_fields(event),
            "extra_keys": [list(key) for key in event.extra_keys],
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [bytes(h) for h in event.block_hashes]}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def _event_from_wire(item: dict[str, Any]) -> KVEvent:
    kind = item.get("type")
    if kind == "BlockStored":
        parent = item["parent_block_hash"]
        return BlockStored(
            block_hashes=tuple(BlockHash(h) for h in item["block_hashes"]),
            parent_block_hash=None if parent is None else BlockHash(parent),
            token_ids=tuple(item["token_ids"]),
            block_size=item["block_size"],
            extra_keys=tuple(tuple(key) for key in item["extra_keys"]),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=tuple(BlockHash(h) for h in item["block_hashes"]))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


def encode_batch(batch: EventBatch) -> bytes:
    return msgpack.packb(
        {
            "v": WIRE_VERSION,
            "epoch": batch.epoch,
            "seq": batch.seq,
            "ts": batch.timestamp,
            "events": [_event_to_wire(e) for e in batch.events],
        },
        use_bin_type=True,
    )


def decode_batch(data: bytes) -> EventBatch:
    """Raises ValueError on anything that is not a well-formed batch of this wire version."""
    try:
        raw = msgpack.unpackb(data, raw=False)
        if raw["v"] != WIRE_VERSION:
            raise ValueError(f"wire version {raw['v']}, expected {WIRE_VERSION}")
        seq = raw["seq"]
        if not isinstance(seq, int) or seq < 1:
            raise ValueError(f"seq must be an integer >= 1, got {seq!r}")
        epoch = raw["epoch"]
        if not isinstance(epoch, str):
            raise ValueError(f"epoch must be a string, got {epoch!r}")
        events = tuple(_event_from_wire(e) for e in raw["events"])
        return EventBatch(epoch, seq, float(raw["ts"]), events)
    except (KeyError, TypeError, msgpack.UnpackException, ValueError) as exc:
        raise ValueError(f"malformed KV event message: {exc}") from None


class EventPublisher(Protocol):
    """What the server needs of a KV event publisher (KVEventPublisher, or vLLM's wire format in
    vllm_kv_events.VllmKVEventPublisher): where it publishes, its stream's epoch and last batch
    number (named by /kv/blocks), the engine-thread callback, and close."""

    endpoint: str
    epoch: str
    seq: int

    def publish(self, events: Sequence[KVEvent]) -> None: ...

    def close(self) -> None: ...


class KVEventPublisher:
    """Owns a PUB socket bound to `endpoint`, and the sequence counter.

    publish() must be called from one thread (the engine thread): ZeroMQ sockets are not
    thread-safe, and the seq a snapshot reports must be the one of the last step it includes.
    """

    def __init__(self, endpoint: str, *, send_hwm: int = 100_000) -> None:
        self.endpoint = endpoint
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, send_hwm)  # beyond it PUB drops: subscribers resync
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"kv_events_endpoint {endpoint!r} cannot be bound: {exc}") from None
        self.epoch = uuid.uuid4().hex[:16]
        self.seq = 0  # of the last batch published; 0 = none yet

    def publish(self, events: Sequence[KVEvent]) -> None:
        if not events:
            return
        self.seq += 1
        data = encode_batch(EventBatch(self.epoch, self.seq, time.time(), tuple(events)))
        try:
            self._socket.send_multipart([TOPIC, data], flags=zmq.NOBLOCK)
        except zmq.Again:  # no room: the batch is lost, and subscribers see the gap
            logger.debug("KV events: batch %d dropped (send queue full)", self.seq)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
