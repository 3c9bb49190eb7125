"""Block hashing: namespace roots, canonical encoding, extra keys, hash-once extension."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmemo.kv.hashing import (
    HASH_ALGORITHMS,
    BlockHash,
    RequestHasher,
    extra_keys_for_range,
    hash_block,
    namespace_root_hash,
)
from kvmemo.kv.mm_items import MultiModalItem
from tests.kv.kv_testing import make_hasher, make_request

_NS = dict(weights_fingerprint="w1", kv_cache_dtype="bfloat16", block_size=16)


def test_namespace_root_differs_in_every_input() -> None:
    base = namespace_root_hash(**_NS)
    assert base == namespace_root_hash(**_NS)
    variants = [
        namespace_root_hash(**{**_NS, "weights_fingerprint": "w2"}),
        namespace_root_hash(**{**_NS, "kv_cache_dtype": "fp8_e4m3"}),
        namespace_root_hash(**{**_NS, "block_size": 32}),
        namespace_root_hash(**_NS, layout_version=2),
        namespace_root_hash(**_NS, algorithm="sha256"),
    ]
    assert len({base, *variants[:4]}) == 5
    assert variants[4] == base  # sha256 is the default


def test_namespace_root_is_deterministic_across_processes() -> None:
    code = (
        "from kvmemo.kv.hashing import namespace_root_hash, hash_block\n"
        "root = namespace_root_hash(\n"
        "    weights_fingerprint='w1', kv_cache_dtype='bfloat16', block_size=16)\n"
        "print(hash_block(root, [1, 2, 3], ((b'img', -2), ('lora', 'x'))).hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    root = namespace_root_hash(**_NS)
    assert out.stdout.strip() == hash_block(root, [1, 2, 3], ((b"img", -2), ("lora", "x"))).hex()


def test_unknown_algorithm_is_a_value_error_listing_allowed() -> None:
    with pytest.raises(ValueError, match="sha256"):
        namespace_root_hash(**_NS, algorithm="md5")
    with pytest.raises(ValueError, match="xxh3_128"):
        RequestHasher(BlockHash(b"r"), 16, algorithm="crc32")
    with pytest.raises(ValueError, match="block_size"):
        namespace_root_hash(**{**_NS, "block_size": 0})


def test_xxh3_is_an_option() -> None:
    pytest.importorskip("xxhash")
    root = namespace_root_hash(**_NS, algorithm="xxh3_128")
    assert len(root) == 16 and root != namespace_root_hash(**_NS)
    assert hash_block(root, [1], (), "xxh3_128") == hash_block(root, [1], (), "xxh3_128")
    assert "xxh3_128" in HASH_ALGORITHMS


def test_encoding_is_unambiguous() -> None:
    root = BlockHash(b"root")
    assert hash_block(root, [1, 2], ()) != hash_block(root, [2, 1], ())
    assert hash_block(root, [1], ()) != hash_block(BlockHash(b"root2"), [1], ())
    assert hash_block(root, [1], (("a",),)) != hash_block(root, [1], ((b"a",),))
    assert hash_block(root, [1], ("ab", "c")) != hash_block(root, [1], ("a", "bc"))
    assert hash_block(root, [1], ((b"x", 1),)) != hash_block(root, [1], ((b"x", -1),))
    assert hash_block(root, [1], ()) != hash_block(root, [1], ((),))
    assert hash_block(root, [256], ()) != hash_block(root, [1, 0], ())  # fixed-width ids
    with pytest.raises(TypeError):
        hash_block(root, [1], (1.5,))


def test_extra_keys_order_mm_salt() -> None:
    items = [MultiModalItem(2, 3, b"img-a"), MultiModalItem(6, 4, b"img-b")]
    req = make_request("r", list(range(16)), mm_items=items, cache_salt="s")
    assert extra_keys_for_range(req, 0, 4) == ((b"img-a", -2), ("salt", "s"))
    assert extra_keys_for_range(req, 4, 8) == ((b"img-a", 2), (b"img-b", -2))
    assert extra_keys_for_range(req, 8, 12) == ((b"img-b", 2),)
    assert extra_keys_for_range(req, 12, 16) == ()


@settings(max_examples=100, deadline=None)
@given(
    gaps=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), max_size=8),
    start=st.integers(0, 60),
    width=st.integers(1, 8),
)
def test_extra_keys_match_a_linear_scan(
    gaps: list[tuple[int, int]], start: int, width: int
) -> None:
    items, offset = [], 0
    for i, (gap, length) in enumerate(gaps):
        offset += gap
        items.append(MultiModalItem(offset, length, bytes([i])))
        offset += length
    req = make_request("r", [0], mm_items=items)
    end = start + width
    expected = tuple(
        (it.content_hash, start - it.offset)
        for it in items
        if it.offset < end and start < it.offset + it.length
    )
    assert extra_keys_for_range(req, start, end) == expected


def test_extend_hashes_each_block_exactly_once() -> None:
    hasher = make_hasher(block_size=4)
    req = make_request("r", [1, 2, 3], hasher=hasher)
    hasher.extend(req)
    assert req.block_hashes == [] and hasher.num_hashed_blocks == 0
    for token in range(4, 30):
        req.append_output_token(token)  # the request extends its own hashes
        hasher.extend(req)  # idempotent
    assert len(req.block_hashes) == 29 // 4 == hasher.num_hashed_blocks
    fresh = make_hasher(block_size=4)
    whole = make_request("w", req.all_token_ids, hasher=fresh)
    fresh.extend(whole)
    assert whole.block_hashes == req.block_hashes  # incremental == all at once
    assert fresh.num_hashed_blocks == 7


def test_chain_through_parent_and_extra_keys() -> None:
    hasher = make_hasher(block_size=4)
    plain = make_request("a", list(range(12)), hasher=hasher)
    salted = make_request("b", list(range(12)), cache_salt="tenant", hasher=hasher)
    salted2 = make_request("c", list(range(12)), cache_salt="tenant", hasher=hasher)
    other = make_request("d", list(range(12)), cache_salt="other-tenant", hasher=hasher)
    image = make_request("e", list(range(12)), mm_items=[MultiModalItem(5, 4, b"cat")], hasher=hasher)
    image2 = make_request("f", list(range(12)), mm_items=[MultiModalItem(5, 4, b"dog")], hasher=hasher)
    for req in (plain, salted, salted2, other, image, image2):
        hasher.extend(req)
    assert salted.block_hashes == salted2.block_hashes
    assert not set(salted.block_hashes) & set(plain.block_hashes)  # salt isolates the chain
    assert not set(other.block_hashes) & set(salted.block_hashes)  # one salt per tenant
    assert image.block_hashes[0] == image2.block_hashes[0] == plain.block_hashes[0]
    assert image.block_hashes[1] != image2.block_hashes[1]  # overlaps the image
    assert image.block_hashes[2] != image2.block_hashes[2]  # overlaps it, and chains from it


def test_unsorted_mm_items_are_rejected() -> None:
    hasher = make_hasher(block_size=4)
    items = [MultiModalItem(6, 2, b"b"), MultiModalItem(0, 2, b"a")]
    with pytest.raises(ValueError, match="mm_items"):
        hasher.extend(make_request("r", list(range(8)), mm_items=items))
