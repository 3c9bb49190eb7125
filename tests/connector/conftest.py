"""Connector-test fixtures: a small store namespace and block payloads, no model needed."""

from __future__ import annotations

import hashlib

import pytest

from kvmemo.connector.store import StoreNamespace
from kvmemo.kv.hashing import BlockHash


@pytest.fixture
def namespace() -> StoreNamespace:
    # [num_layers, 2, block_size, num_kv_heads, head_dim] float32: 2*2*4*2*8*4 = 1 KiB a block
    return StoreNamespace(
        root_hash=hashlib.sha256(b"test-root").digest(),
        model_name="Test/Model-1",
        dtype="float32",
        block_shape=(2, 2, 4, 2, 8),
        itemsize=4,
    )


def block_hash(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"block-{i}".encode()).digest())


def payload(namespace: StoreNamespace, i: int) -> bytes:
    seed = hashlib.sha256(f"payload-{i}".encode()).digest()
    return (seed * (namespace.payload_bytes // len(seed) + 1))[: namespace.payload_bytes]
