"""KV events over a real ZeroMQ PUB/SUB pair: wire round trip, gap detection and resync."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from kvmemo.kv.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from kvmemo.kv.hashing import BlockHash  # noqa: E402
from kvmemo.routing.block_index import ReplicaBlockIndex, follow_events  # noqa: E402
from kvmemo.server.kv_events import (  # noqa: E402
    EventBatch,
    KVEventPublisher,
    decode_batch,
    encode_batch,
)
from tests.redis_server import free_port  # noqa: E402


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"b{i}".encode()).digest())


def stored(*ids: int, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(h(i) for i in ids),
        parent_block_hash=None if parent is None else h(parent),
        token_ids=tuple(range(4 * len(ids))),
        block_size=4,
        extra_keys=((b"\x01" * 32, -3), ("salt", "tenant-a")),
    )


def test_wire_round_trip_keeps_every_field():
    batch = EventBatch("e1", 7, 123.5, (stored(1, 2, parent=0), BlockRemoved((h(1),)), AllBlocksCleared()))
    assert decode_batch(encode_batch(batch)) == batch


@pytest.mark.parametrize("data", [b"", b"\x93\x01\x02\x03", b"\xc1"])
def test_malformed_messages_raise_value_error(data):
    with pytest.raises(ValueError, match="malformed"):
        decode_batch(data)


def test_index_applies_in_order_and_flags_a_gap():
    index = ReplicaBlockIndex()
    assert not index.apply(EventBatch("e", 1, 0.0, (stored(1),)))  # never synced
    assert index.resync("e", 0, [])  # the held batch 1 is applied after the snapshot
    assert index.hashes == {h(1)}
    assert index.apply(EventBatch("e", 2, 0.0, (stored(2), stored(3))))
    assert index.apply(EventBatch("e", 3, 0.0, (BlockRemoved((h(2),)),)))
    assert index.hashes == {h(1), h(3)} and index.matched_blocks([h(1), h(3), h(4)]) == 2
    assert index.apply(EventBatch("e", 3, 0.0, (stored(9),)))  # duplicate: ignored
    assert h(9) not in index.hashes
    assert not index.apply(EventBatch("e", 5, 0.0, (stored(5),)))  # 4 is missing
    assert index.needs_resync and index.num_gaps == 1
    assert not index.apply(EventBatch("e", 6, 0.0, (stored(6),)))  # held until the snapshot
    # The snapshot covers up to seq 5; only batch 6 is newer.
    assert index.resync("e", 5, [h(1), h(3), h(4), h(5)])
    assert index.hashes == {h(1), h(3), h(4), h(5), h(6)} and index.last_seq == 6
    # A restarted replica starts a new epoch at seq 1: that is a gap too.
    assert not index.apply(EventBatch("f", 1, 0.0, (AllBlocksCleared(),)))
    assert index.num_gaps == 2


def test_subscriber_detects_a_dropped_message_and_resyncs():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = KVEventPublisher(endpoint)
    truth: set[bytes] = set()  # the replica's block map, as the snapshot endpoint would see it
    snapshots: list[int] = []

    def publish(events, drop: bool = False) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                truth.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                truth.difference_update(e.block_hashes)
        if drop:  # lost on the way: the seq is used up, the message never arrives
            publisher.seq += 1
        else:
            publisher.publish(events)

    async def snapshot():
        snapshots.append(publisher.seq)
        return publisher.epoch, publisher.seq, list(truth)

    async def scenario() -> ReplicaBlockIndex:
        index = ReplicaBlockIndex()
        task = asyncio.create_task(follow_events(endpoint, index, snapshot))
        try:
            async def until(cond, what):
                for _ in range(200):
                    if cond():
                        return
                    await asyncio.sleep(0.02)
                raise AssertionError(f"timed out waiting for {what}")

            await until(lambda: index.last_seq == 0, "the initial snapshot")
            # PUB drops messages until the subscription has propagated: publish until one lands.
            n = 0
            while index.last_seq == 0:
                n += 1
                publish([stored(100 + n)])
                await asyncio.sleep(0.05)
                assert n < 100, "subscription never connected"
            await until(lambda: index.last_seq == publisher.seq, "catching up")
            assert index.hashes == truth
            gaps_before = index.num_gaps
            publish([stored(1, 2)])
            publish([stored(3), BlockRemoved((h(1),))], drop=True)
            publish([stored(4)])
            await until(lambda: index.num_gaps > gaps_before, "the gap")
            await until(lambda: index.last_seq == publisher.seq, "the resync")
            return index
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        index = asyncio.run(scenario())
    finally:
        publisher.close()
    assert index.num_gaps >= 1 and index.num_resyncs >= 2  # initial sync + the gap's resync
    assert index.hashes == truth  # block 3 (only in the lost message) is known, block 1 is gone
    assert h(3) in index.hashes and h(1) not in index.hashes
