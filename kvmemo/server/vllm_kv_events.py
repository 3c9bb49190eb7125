"""KV events in vLLM's wire format, so routers written for vLLM (llm-d's KV-cache scorer,
Dynamo's KV router, Ray Serve LLM) consume a kvmemo replica unchanged.

The format (vllm/distributed/kv_events.py, ZmqEventPublisher):
- PUB: multipart (topic, 8-byte big-endian sequence number from 0, msgpack payload).
- payload: `KVEventBatch`, a msgspec array-like struct: [ts, events] (data_parallel_rank, a
  trailing default, is omitted). Each event is a msgspec tagged struct encoded as a map with
  "type" = "BlockStored" | "BlockRemoved" | "AllBlocksCleared"; fields with defaults are omitted
  when unset, the others always present (None where kvmemo has nothing to say).
- replay: a ROUTER socket. A DEALER sends (b"", start_seq as 8 bytes) and gets back every
  buffered batch with seq >= start_seq as (b"", topic, seq, payload), then (b"", b"", -1 as
  8 signed bytes, b"").

Hash mapping: a block hash in these events is kvmemo's BlockHash, the 32-byte sha256 (or 16-byte
xxh3_128) chain hash of docs/design.md, sent as msgpack bin; vLLM's ExternalBlockHash is bytes
or int, so consumers take it as an opaque key. A router computes the same hashes for a prompt
from GET /kv/info (namespace root, block size, algorithm). Only the full-attention group's blocks
are announced (a hybrid model's sliding groups follow them: kv/hybrid.py).

Invariant: publish() runs on the engine thread only (it owns the PUB socket); the replay thread
owns the ROUTER socket and reads the buffer under its lock.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from kvmemo.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmemo.server.kv_events import stored_fields

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def vllm_event(event: KVEvent, medium: str) -> dict[str, Any]:
    """One event as vLLM's msgspec struct encodes it (a tagged map)."""
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            **stored_fields(event),
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }
        if event.extra_keys:  # one entry per block: kvmemo's events carry one block each
            keys = tuple(list(key) if isinstance(key, tuple) else key for key in event.extra_keys)
            out["extra_keys"] = [keys] * len(event.block_hashes)
        return out
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [bytes(h) for h in event.block_hashes],
            "medium": medium,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_vllm_batch(events: Sequence[KVEvent], ts: float, medium: str) -> bytes:
    return msgpack.packb([ts, [vllm_event(e, medium) for e in events]], use_bin_type=True)


class VllmKVEventPublisher:
    """PUB socket on `endpoint`, replay ROUTER on `replay_endpoint`, and the last
    `buffer_steps` batches for replay. Same surface as KVEventPublisher (endpoint, epoch, seq of
    the last batch, publish, close); seq counts from 0 as vLLM's does (-1: none yet)."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        medium: str = "CPU",
        buffer_steps: int = 10_000,
        send_hwm: int = 100_000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.medium = medium
        self.epoch = uuid.uuid4().hex[:16]
        self.seq = -1
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, send_hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                router = self._context.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(replay_endpoint)
                self._replay_thread = threading.Thread(
                    target=self._serve_replay, args=(router,), name="kvmemo-kv-replay",
                    daemon=True,
                )
                self._replay_thread.start()
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"KV events endpoint cannot be bound: {exc}") from None

    def publish(self, events: Sequence[KVEvent]) -> None:
        if not events:
            return
        self.seq += 1
        payload = encode_vllm_batch(events, time.time(), self.medium)
        seq_bytes = self.seq.to_bytes(8, "big")
        with self._lock:
            self._buffer.append((self.seq, payload))
        try:
            self._pub.send_multipart((self.topic, seq_bytes, payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # the subscriber sees the gap and replays it
            logger.debug("KV events: batch %d not sent (send queue full)", self.seq)

    def _serve_replay(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    logger.warning("KV events: ignoring a replay request of %d frames", len(frames))
                    continue
                client, _, start = frames
                start_seq = int.from_bytes(start, "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start_seq]
                for seq, payload in batches:
                    seq_bytes = seq.to_bytes(8, "big")
                    router.send_multipart((client, b"", self.topic, seq_bytes, payload))
                router.send_multipart((client, b"", b"", END_SEQ, b""))
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        self._pub.close(linger=0)
        self._context.term()
