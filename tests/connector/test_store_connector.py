"""StoreKVConnector without a model: match rules, loads into pages, saves off the device, and the
DictStore example of docs/connector.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvmemo.attention.cache import PagedKVCache
from kvmemo.connector.disk import DiskStore
from kvmemo.connector.store_connector import StoreKVConnector, namespace_for
from kvmemo.kv.events import BlockRemoved, BlockStored
from kvmemo.kv.hashing import RequestHasher, namespace_root_hash
from kvmemo.request import Request
from kvmemo.sampling import SamplingParams

BS = 4
DOC = Path(__file__).resolve().parents[2] / "docs" / "connector.md"


def _cache(dtype=torch.float32) -> PagedKVCache:
    return PagedKVCache.allocate(
        num_layers=3,
        num_blocks=8,
        block_size=BS,
        num_kv_heads=2,
        head_dim=4,
        dtype=dtype,
        device="cpu",
    )


def _request(num_tokens: int, hasher: RequestHasher, rid: str = "r") -> Request:
    request = Request(
        request_id=rid,
        prompt_token_ids=list(range(100, 100 + num_tokens)),
        sampling_params=SamplingParams(),
        cache_salt=None,
        eos_token_ids=frozenset(),
        hasher=hasher,
    )
    return request


def _hasher() -> RequestHasher:
    root = namespace_root_hash(weights_fingerprint="w", kv_cache_dtype="float32", block_size=BS)
    return RequestHasher(root, BS, "sha256")


def _dict_store_class():
    code = re.search(
        r"```python\n(from dataclasses import replace.*?)```", DOC.read_text(), re.DOTALL
    ).group(1)
    scope: dict = {}
    exec(code, scope)  # noqa: S102 -- the doc's own example, run as written
    return scope["DictStore"]


@pytest.fixture(params=["dict", "disk"])
def setup(request, tmp_path):
    hasher = _hasher()
    src = _cache()
    for t in (*src.k_caches, *src.v_caches):
        t.copy_(torch.randn_like(t))
    namespace = namespace_for(hasher.root, "toy", src)
    store = (
        _dict_store_class()() if request.param == "dict" else DiskStore(tmp_path, 2**30, namespace)
    )
    return hasher, src, namespace, store


def test_save_then_load_round_trips_every_layer(setup):
    hasher, src, namespace, store = setup
    saver = StoreKVConnector(store, namespace, BS)
    saver.register_kv_caches(src)
    request = _request(14, hasher)  # 3 full blocks + 2 tokens
    assert len(request.block_hashes) == 3
    table = [5, 2, 7]  # where the request's blocks live in the source pool

    events = [
        BlockStored(
            block_hashes=(h,),
            parent_block_hash=None,
            token_ids=(),
            block_size=BS,
            extra_keys=(),
        )
        for h in request.block_hashes
    ]
    events.append(BlockRemoved(block_hashes=(request.block_hashes[0],)))
    pool = dict(zip(request.block_hashes, table))

    saves = saver.blocks_to_save(events, pool.get)
    # Last block first: a store dropping its least recently written keeps a chain's head longest.
    assert saves == list(zip(request.block_hashes, table))[::-1]
    saver.save_blocks(saves)
    saver.wait_for_save()
    assert saver.blocks_to_save(events, pool.get) == []  # already stored

    dst = _cache()
    loader = StoreKVConnector(store, namespace, BS)
    loader.register_kv_caches(dst)
    num_tokens = loader.get_num_new_matched_tokens(request, 0)
    assert num_tokens == 12
    loader.update_state_after_alloc(request, [1, 3, 4, 6], num_tokens)
    metadata = loader.build_connector_meta()
    assert [load.block_id for load in metadata.loads] == [1, 3, 4]
    loader.start_load_kv(metadata)
    for layer in range(3):
        for s, d in zip(table, [1, 3, 4]):
            assert torch.equal(dst.k_caches[layer][d], src.k_caches[layer][s])
            assert torch.equal(dst.v_caches[layer][d], src.v_caches[layer][s])
    assert loader.stats.hit_tokens == 12 and loader.stats.miss_tokens == 2
    assert loader.build_connector_meta().loads == ()  # loads go out once


def test_match_leaves_the_last_token_and_starts_at_the_block_boundary(setup):
    hasher, src, namespace, store = setup
    connector = StoreKVConnector(store, namespace, BS)
    connector.register_kv_caches(src)
    request = _request(12, hasher)  # exactly 3 full blocks: the last one holds the last token
    connector.save_blocks(list(zip(request.block_hashes, [0, 1, 2])))
    connector.wait_for_save()
    assert connector.get_num_new_matched_tokens(request, 0) == 8
    assert connector.get_num_new_matched_tokens(request, 6) == 4  # from block 1 on
    assert connector.get_num_new_matched_tokens(request, 8) == 0


def test_match_stops_at_the_first_missing_block(setup):
    hasher, src, namespace, store = setup
    connector = StoreKVConnector(store, namespace, BS)
    connector.register_kv_caches(src)
    request = _request(20, hasher)
    connector.save_blocks([(request.block_hashes[0], 0), (request.block_hashes[2], 2)])
    connector.wait_for_save()
    assert connector.get_num_new_matched_tokens(request, 0) == 4


def test_unconfirmed_match_is_dropped(setup):
    hasher, src, namespace, store = setup
    connector = StoreKVConnector(store, namespace, BS)
    connector.register_kv_caches(src)
    request = _request(9, hasher)
    connector.save_blocks([(request.block_hashes[0], 0)])
    connector.wait_for_save()
    assert connector.get_num_new_matched_tokens(request, 0) == 4
    assert connector.build_connector_meta().loads == ()  # never allocated: nothing to load
    with pytest.raises(ValueError, match="num_external_tokens"):
        connector.update_state_after_alloc(request, [3], 4)


def test_bfloat16_and_fp8_pages_round_trip(tmp_path):
    hasher = _hasher()
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        src = _cache(dtype)
        for t in (*src.k_caches, *src.v_caches):
            t.copy_(torch.randn(t.shape).to(dtype))
        namespace = namespace_for(hasher.root, "toy", src)
        store = DiskStore(tmp_path / str(dtype), 2**30, namespace)
        connector = StoreKVConnector(store, namespace, BS)
        connector.register_kv_caches(src)
        request = _request(5, hasher)
        connector.save_blocks([(request.block_hashes[0], 6)])
        connector.wait_for_save()
        dst = _cache(dtype)
        connector.register_kv_caches(dst)
        n = connector.get_num_new_matched_tokens(request, 0)
        connector.update_state_after_alloc(request, [2], n)
        connector.start_load_kv(connector.build_connector_meta())
        assert torch.equal(
            dst.k_caches[1][2].view(torch.uint8), src.k_caches[1][6].view(torch.uint8)
        )
