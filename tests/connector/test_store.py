"""Block payload encoding: round trip, and every header or payload mismatch is a logged miss."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvmemo.connector.store import (
    MAGIC,
    StoreNamespace,
    decode_block,
    encode_block,
    sanitize_model_name,
)
from tests.connector.conftest import block_hash, payload


def test_round_trip(namespace):
    data = encode_block(namespace, block_hash(1), payload(namespace, 1))
    assert data.startswith(MAGIC)
    assert decode_block(namespace, block_hash(1), data) == payload(namespace, 1)


def test_encode_rejects_wrong_payload_size(namespace):
    with pytest.raises(ValueError, match="payload must be"):
        encode_block(namespace, block_hash(1), b"short")


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda ns: dataclasses.replace(ns, root_hash=b"\x01" * 32), "another namespace"),
        (
            lambda ns: dataclasses.replace(
                ns, dtype="bfloat16", itemsize=2, block_shape=(2, 2, 4, 2, 16)
            ),
            "dtype",
        ),
        (lambda ns: dataclasses.replace(ns, block_shape=(2, 2, 4, 4, 4)), "shape"),
    ],
)
def test_foreign_header_is_a_miss(namespace, caplog, change, reason):
    data = encode_block(namespace, block_hash(1), payload(namespace, 1))
    with caplog.at_level(logging.WARNING):
        assert decode_block(change(namespace), block_hash(1), data) is None
    assert reason in caplog.text


def test_other_block_hash_is_a_miss(namespace, caplog):
    data = encode_block(namespace, block_hash(1), payload(namespace, 1))
    with caplog.at_level(logging.WARNING):
        assert decode_block(namespace, block_hash(2), data) is None
    assert "another block hash" in caplog.text


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (lambda d: d[:-1], "payload is"),
        (lambda d: d[:20], "truncated header"),
        (lambda d: b"", "truncated header"),
        (lambda d: d[:-5] + bytes([d[-5] ^ 0x01]) + d[-4:], "sha256 mismatch"),
        (lambda d: b"XXXX" + d[4:], "bad magic"),
        (lambda d: d[:4] + b"\x09\x00" + d[6:], "format version"),
        (lambda d: d + b"\x00", "payload is"),
    ],
)
def test_corrupt_bytes_are_a_miss(namespace, caplog, corrupt, reason):
    data = encode_block(namespace, block_hash(1), payload(namespace, 1))
    with caplog.at_level(logging.WARNING):
        assert decode_block(namespace, block_hash(1), corrupt(data)) is None
    assert reason in caplog.text


def test_namespace_dir_name(namespace):
    assert namespace.dir_name == "test-model-1_" + namespace.root_hash.hex()[:32]
    assert sanitize_model_name("../../etc/Passwd") == "etc-passwd"
    assert sanitize_model_name("...") == "model"


def test_namespace_validation():
    with pytest.raises(ValueError, match="block_shape"):
        StoreNamespace(
            root_hash=b"r", model_name="m", dtype="float32", block_shape=(1, 2), itemsize=4
        )
    with pytest.raises(ValueError, match="root_hash"):
        StoreNamespace(
            root_hash=b"", model_name="m", dtype="float32", block_shape=(1, 2, 1, 1, 1), itemsize=4
        )
