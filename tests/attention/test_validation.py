"""Metadata inconsistent with the batch or the cache raises a ValueError naming what is wrong."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvmemo.attention.backend import PagedAttentionBackend, ReferenceAttentionBackend
from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.fp8 import KVScales
from kvmemo.attention.metadata import AttentionMetadata
from tests.attention.paged_testing import HEAD_DIM, make_batch

pytestmark = pytest.mark.usefixtures("decode_path")  # kernel and gather decodes

GOOD = dict(block_tables=[[0, 1], [2]], num_computed_tokens=[17, 3], query_lens=[1, 2],
            block_size=16, num_cache_blocks=4)


def build(**changes) -> AttentionMetadata:
    return AttentionMetadata.build(**{**GOOD, **changes})


def test_good_metadata_maps_slots_and_lengths():
    md = build()
    assert md.num_seqs == 2 and not hasattr(md, "request_ids")  # positions in a batch, no owners
    assert md.slot_mapping.tolist() == [1 * 16 + 1, 2 * 16 + 3, 2 * 16 + 4]
    assert md.seq_lens == [18, 5] and md.query_start_loc == [0, 1, 3]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(block_tables=[[0, 1], [2], [3]]), r"'block_tables': 3.* for 2 sequences"),
        (dict(block_tables=[[0, 1]]), r"'block_tables': 1.* for 2 sequences"),
        (dict(num_computed_tokens=[17]), r"'num_computed_tokens': 1.* for 2 sequences"),
        (dict(num_computed_tokens=[40, 3]), r"sequence 0 has 2 blocks, too short for a context of 41"),
        (dict(block_tables=[[0, 1], []]), r"sequence 1 has 0 blocks"),
        (dict(block_tables=[[0, 4], [2]]), r"block id outside \[0, 4\)"),
        (dict(block_tables=[[0, 1], [-1]]), r"block id outside \[0, 4\)"),
        (dict(query_lens=[1, 0]), r"query_lens of sequence 1 must be an integer >= 1"),
        (dict(num_computed_tokens=[17, -1]), r"num_computed_tokens of sequence 1 must be an integer >= 0"),
        (dict(query_lens=[1, "2"]), r"query_lens of sequence 1 must be an integer >= 1"),
        (dict(block_size=0), r"block_size must be a positive integer"),
    ],
)
def test_inconsistent_metadata_raises(changes, message):
    with pytest.raises(ValueError, match=message):
        build(**changes)


def test_small_and_large_steps_map_the_same_slots_and_catch_the_same_ids():
    """A step small enough builds its slots and checks in Python, a larger one with tensor ops:
    the same slots (against the formula written out here) and the same error either way."""
    from kvmemo.attention import metadata

    gen = torch.Generator().manual_seed(0)
    for num_seqs in (1, 3, 40):
        computed = torch.randint(0, 100, (num_seqs,), generator=gen).tolist()
        query_lens = torch.randint(1, 30, (num_seqs,), generator=gen).tolist()
        tables = [torch.randint(0, 500, (-(-(c + q) // 16),), generator=gen).tolist()
                  for c, q in zip(computed, query_lens)]
        expected = [t[p // 16] * 16 + p % 16 for t, c, q in zip(tables, computed, query_lens)
                    for p in range(c, c + q)]
        for limit in (0, 10**6):  # every step large, every step small
            original = metadata._SMALL_STEP
            metadata._SMALL_STEP = limit
            try:
                md = AttentionMetadata.build(block_tables=tables, num_computed_tokens=computed,
                                             query_lens=query_lens, block_size=16,
                                             num_cache_blocks=500)
                assert md.slot_mapping.tolist() == expected
                bad = [t[:] for t in tables]
                bad[-1][-1] = 500
                with pytest.raises(ValueError, match=rf"sequence {num_seqs - 1} holds a block id"):
                    AttentionMetadata.build(block_tables=bad, num_computed_tokens=computed,
                                            query_lens=query_lens, block_size=16,
                                            num_cache_blocks=500)
            finally:
                metadata._SMALL_STEP = original


@pytest.mark.parametrize("backend_cls", [PagedAttentionBackend, ReferenceAttentionBackend])
def test_backend_rejects_metadata_of_another_pool_or_batch(backend_cls):
    batch = make_batch(cached=[5, 9], new=[1, 3], group=3, block_size=8, seed=0)
    backend = backend_cls(HEAD_DIM**-0.5)
    md = batch.metadata
    smaller = PagedKVCache.allocate(num_layers=1, num_blocks=2, block_size=8, num_kv_heads=2,
                                    head_dim=HEAD_DIM, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="num_cache_blocks"):  # slots could lie outside this cache
        backend.forward(0, batch.q, batch.new_k, batch.new_v, smaller, md)
    other_block_size = PagedKVCache.allocate(num_layers=1, num_blocks=batch.cache.num_blocks, block_size=16,
                                             num_kv_heads=2, head_dim=HEAD_DIM, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="block_size"):
        backend.forward(0, batch.q, batch.new_k, batch.new_v, other_block_size, md)
    with pytest.raises(ValueError, match="one row per token of the step"):
        backend.forward(0, batch.q[:-1], batch.new_k[:-1], batch.new_v[:-1], batch.cache, md)
    with pytest.raises(ValueError, match="kv heads"):
        backend.forward(0, batch.q, batch.new_k[:, :1], batch.new_v[:, :1], batch.cache, md)


def test_fp8_scales_are_validated_and_only_for_fp8():
    fp8 = PagedKVCache.allocate(num_layers=2, num_blocks=2, block_size=8, num_kv_heads=3, head_dim=8,
                                dtype=torch.float8_e4m3fn, device="cpu")
    with pytest.raises(ValueError, match=r"k_scales must be positive with shape \(2, 3\)"):
        fp8.set_scales(torch.ones(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="v_scales must be positive"):
        fp8.set_scales(torch.ones(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"k_offsets must be finite with shape \(2, 3, 8\)"):
        fp8.set_scales(torch.ones(2, 3), torch.ones(2, 3), k_offsets=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="v_offsets must be finite"):
        fp8.set_scales(torch.ones(2, 3), torch.ones(2, 3), v_offsets=torch.full((2, 3, 8), float("nan")))
    with pytest.raises(ValueError, match=r"rotation must be an orthogonal \(8, 8\) matrix"):
        fp8.set_scales(torch.ones(2, 3), torch.ones(2, 3), rotation=torch.eye(8) * 2)
    fp32 = PagedKVCache.allocate(num_layers=2, num_blocks=2, block_size=8, num_kv_heads=3, head_dim=8,
                                 dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="fp8 KV cache only"):
        fp32.set_scales(torch.ones(2, 3), torch.ones(2, 3))


def test_scale_digest_changes_with_any_scale_offset_or_rotation():
    base = KVScales.plain(torch.full((2, 3), 0.25), torch.full((2, 3), 0.5), head_dim=4)
    same = KVScales(base.k.clone(), base.v.clone(), base.k_offset.clone(), base.v_offset.clone(),
                    base.rotation.clone())
    assert base.digest() == same.digest()
    k = base.k.clone()
    k[1, 2] = 0.125
    assert replace(base, k=k).digest() != base.digest()
    assert replace(base, k=base.v, v=base.k).digest() != base.digest()  # K and V are not interchangeable
    offset = base.k_offset.clone()
    offset[0, 1, 3] = 0.5
    assert replace(base, k_offset=offset).digest() != base.digest()
    assert replace(base, v_offset=offset).digest() not in (base.digest(), replace(base, k_offset=offset).digest())
    assert replace(base, rotation=base.rotation[[1, 0, 2, 3]]).digest() != base.digest()


def test_fast_fp8_conversion_is_exact_for_every_byte():
    from kvmemo.attention.cache import fp8_to_float

    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = every[~every.float().isnan()]
    out = fp8_to_float(finite, torch.empty(finite.shape), torch.empty(finite.shape, dtype=torch.int16))
    assert torch.equal(out, finite.float())


@pytest.mark.parametrize("window", [None, 8], ids=["full", "window-8"])
def test_metadata_for_other_tables_equals_a_build_over_them(window):
    """for_tables (a hybrid layout's other groups of one window) gives what `build` gives for
    those tables, and shares the rows' lists and length tensors with the metadata it came from;
    released blocks (None) before a window's first block are allowed, as in `build`."""
    common = dict(num_computed_tokens=[17, 40], query_lens=[1, 2], block_size=16,
                  num_cache_blocks=64, sliding_window=window)
    first = AttentionMetadata.build(block_tables=[[0, 1], [2, 3, 4, 5]], **common)
    other_tables = [[6, 7], [8, 9, 10, 11]] if window is None else [[6, 7], [None, None, 10, 11]]
    shared = first.for_tables(other_tables, common["num_computed_tokens"])
    direct = AttentionMetadata.build(block_tables=other_tables, **common)
    assert torch.equal(shared.block_tables, direct.block_tables)
    assert torch.equal(shared.slot_mapping, direct.slot_mapping)
    assert shared.slot_mapping.tolist() != first.slot_mapping.tolist()
    for name in ("query_start_loc", "query_lens", "seq_lens", "block_size", "num_cache_blocks",
                 "sliding_window"):
        assert getattr(shared, name) == getattr(direct, name), name
    assert torch.equal(shared.seq_lens_t, direct.seq_lens_t)
    assert shared.seq_lens_t is first.seq_lens_t and shared.query_lens_t is first.query_lens_t


def test_metadata_for_other_tables_checks_them():
    first = build()
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        first.for_tables([[0, 9], [2]], GOOD["num_computed_tokens"])
    with pytest.raises(ValueError, match="too short"):
        first.for_tables([[0], [2]], GOOD["num_computed_tokens"])
    with pytest.raises(ValueError, match="2 block tables"):
        first.for_tables([[0, 1], [2]], [17])
    with pytest.raises(ValueError, match="computed counts this metadata was built with"):
        first.for_tables([[0, 1], [2]], [16, 3])
