"""KV events in vLLM's wire format: decoded by a msgspec decoder whose structs are written here
from vLLM's documented schema (vllm/distributed/kv_events.py), over a real ZeroMQ PUB socket; a
gap in the sequence is filled through the replay ROUTER socket with exactly the missed batches."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvmemo import LLM, SamplingParams
from kvmemo.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmemo.kv.hashing import BlockHash
from kvmemo.server.vllm_kv_events import VllmKVEventPublisher
from tests.redis_server import free_port

ExternalBlockHash = bytes | int


# vLLM's structs, as its docs and kv_events.py define them.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def _endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def _subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    return sub


def _wait_connected(publisher: VllmKVEventPublisher, sub: zmq.Socket) -> int:
    """Publishes probes until the subscriber receives one (a PUB drops what it sends before the
    connection is up); returns the next seq."""
    sub.setsockopt(zmq.RCVTIMEO, 100)
    for _ in range(100):
        publisher.publish([AllBlocksCleared()])
        try:
            _, seq, _ = sub.recv_multipart()
            while True:  # drain the probes that arrived
                try:
                    _, seq, _ = sub.recv_multipart()
                except zmq.Again:
                    break
            sub.setsockopt(zmq.RCVTIMEO, 5000)
            return int.from_bytes(seq, "big") + 1
        except zmq.Again:
            continue
    raise AssertionError("subscriber never connected")


def _stored(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=(BlockHash(bytes([i]) * 32),), parent_block_hash=BlockHash(b"\0" * 32),
        token_ids=tuple(range(i, i + 4)), block_size=4, extra_keys=(("salt-a"),),
    )


def test_batches_decode_with_vllms_schema_and_a_gap_replays_exactly_what_was_missed() -> None:
    pub_endpoint, replay_endpoint = _endpoints()
    publisher = VllmKVEventPublisher(pub_endpoint, replay_endpoint=replay_endpoint, topic="kv")
    ctx = zmq.Context()
    try:
        sub = _subscriber(ctx, pub_endpoint)
        first = _wait_connected(publisher, sub)
        published = {}
        for i in range(6):
            events = [_stored(i), BlockRemoved(block_hashes=(BlockHash(bytes([i]) * 32),))]
            publisher.publish(events)
            published[first + i] = events
        received = {}
        for _ in range(6):
            topic, seq_bytes, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq_bytes) == 8
            received[int.from_bytes(seq_bytes, "big")] = payload
        assert sorted(received) == list(range(first, first + 6))  # consecutive, big-endian
        batch = DECODER.decode(received[first])
        stored, removed = batch.events
        assert isinstance(stored, VBlockStored) and isinstance(removed, VBlockRemoved)
        assert stored.block_hashes == [b"\0" * 32] and stored.parent_block_hash == b"\0" * 32
        assert (stored.token_ids, stored.block_size, stored.medium) == ([0, 1, 2, 3], 4, "CPU")
        assert stored.lora_id is None and stored.extra_keys == [("salt-a",)]
        assert removed.block_hashes == [b"\0" * 32] and batch.data_parallel_rank is None

        # The subscriber "lost" seqs first+2 and first+3: it replays from the first missing one.
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(replay_endpoint)
        dealer.send_multipart((b"", (first + 2).to_bytes(8, "big")))
        replayed = {}
        while True:
            _, topic, seq_bytes, payload = dealer.recv_multipart()
            if seq_bytes == (-1).to_bytes(8, "big", signed=True):
                assert topic == b"" and payload == b""
                break
            replayed[int.from_bytes(seq_bytes, "big")] = payload
        assert sorted(replayed) == list(range(first + 2, first + 6))
        assert all(replayed[s] == received[s] for s in replayed)
        assert [DECODER.decode(replayed[s]).events[0].token_ids for s in (first + 2, first + 3)] \
            == [[2, 3, 4, 5], [3, 4, 5, 6]]
        dealer.close(linger=0)
        sub.close(linger=0)
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_an_engines_events_name_the_blocks_it_holds() -> None:
    """Hashes in BlockStored events are the engine's own block hashes (GET /kv/blocks')."""
    pub_endpoint, _ = _endpoints()
    publisher = VllmKVEventPublisher(pub_endpoint)
    ctx = zmq.Context()
    try:
        sub = _subscriber(ctx, pub_endpoint)
        _wait_connected(publisher, sub)
        llm = LLM(num_blocks=64, enable_kv_events=True)
        llm.engine.subscribe_kv_events(publisher.publish)
        llm.generate(["The capital of France is " * 8], SamplingParams(max_tokens=4),
                     use_tqdm=False)
        hashes = []
        sub.setsockopt(zmq.RCVTIMEO, 500)
        while True:
            try:
                _, _, payload = sub.recv_multipart()
            except zmq.Again:
                break
            for event in DECODER.decode(payload).events:
                if isinstance(event, VBlockStored):
                    assert event.block_size == 16 and len(event.token_ids) == 16
                    hashes += event.block_hashes
        assert hashes and sorted(hashes) == sorted(bytes(h) for h in llm.engine.cached_block_hashes())
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_replay_endpoint_needs_the_vllm_format() -> None:
    from kvmemo.server.serve import serve

    with pytest.raises(ValueError, match="needs --kv-events-format vllm"):
        serve(None, kv_events_endpoint=_endpoints()[0],
              kv_events_replay_endpoint=_endpoints()[1], engine_options={"num_blocks": 16})
