"""Cascade (shared-prefix) attention equals the reference, and is used exactly when it applies."""

from __future__ import annotations

import random

import pytest
import torch

from kvmemo.attention import cascade
from kvmemo.attention.cache import PagedKVCache, write_kv
from kvmemo.attention.cascade import (
    cascade_attention,
    cascade_prefix_blocks,
    common_prefix_blocks,
)
from kvmemo.attention.lse_attention import attention_with_lse, attention_with_lse_math
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.attention.paged import paged_attention
from kvmemo.attention.torch_ref import paged_attention_ref

pytestmark = pytest.mark.usefixtures("decode_path")  # kernel and gather decodes

HEAD_DIM = 16
NUM_KV_HEADS = 2


@pytest.fixture
def any_prefix(monkeypatch):
    """Let cascade apply to the tiny prefixes of these tests (the defaults are tuned for speed)."""
    monkeypatch.setattr(cascade, "MIN_PREFIX_TOKENS", 1)
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", 1)


def build_batch(**kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """build_cascade_batch's q, layer 0's logical K/V caches and the metadata."""
    q, cache, md = build_cascade_batch(**kwargs)
    return q, cache.k_caches[0], cache.v_caches[0], md


def build_cascade_batch(
    *,
    prefix_blocks: int,
    block_size: int,
    group: int,
    computed: list[int],
    new: list[int],
    rng: random.Random,
    dtype: torch.dtype = torch.float32,
    ascending_prefix: bool = False,
) -> tuple[torch.Tensor, PagedKVCache, AttentionMetadata]:
    """Sequences whose tables start with the same prefix_blocks physical blocks, own blocks after.

    The shared blocks are random ids, or with ascending_prefix one run of consecutive ids (as a
    prefix computed on a fresh pool gets), the other blocks still shuffled around them.

    Sequence s's K/V for positions [0, computed[s]) is written before the step, the new tokens
    through slot_mapping; shared positions hold one K/V for everybody. Returns q, the cache, md.
    """
    prefix_len = prefix_blocks * block_size
    own_blocks = [-(-(c + n) // block_size) - prefix_blocks for c, n in zip(computed, new)]
    num_blocks = prefix_blocks + sum(max(b, 0) for b in own_blocks) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # physical ids are not contiguous
    if ascending_prefix:
        start = rng.randint(0, num_blocks - prefix_blocks)
        shared = list(range(start, start + prefix_blocks))
        ids = [i for i in ids if i not in shared]
    else:
        shared = [ids.pop() for _ in range(prefix_blocks)]
    tables = [
        shared + [ids.pop() for _ in range(b)] if b >= 0 else shared[: prefix_blocks + b]
        for b in own_blocks
    ]
    cache = PagedKVCache.allocate(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        device="cpu",
    )
    k_cache, v_cache = cache.k_caches[0], cache.v_caches[0]
    shared_k, shared_v = (
        torch.randn(prefix_len, NUM_KV_HEADS, HEAD_DIM),
        torch.randn(prefix_len, NUM_KV_HEADS, HEAD_DIM),
    )
    new_k, new_v = [], []
    for table, c, n in zip(tables, computed, new):
        own_k = torch.randn(c + n, NUM_KV_HEADS, HEAD_DIM)
        own_v = torch.randn(c + n, NUM_KV_HEADS, HEAD_DIM)
        shared_part = min(prefix_len, c + n)
        own_k[:shared_part], own_v[:shared_part] = shared_k[:shared_part], shared_v[:shared_part]
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(c)],
            dtype=torch.int64,
        )
        write_kv(k_cache, v_cache, own_k[:c], own_v[:c], slots)
        new_k.append(own_k[c:])
        new_v.append(own_v[c:])
    md = AttentionMetadata.build(
        block_tables=tables,
        num_computed_tokens=computed,
        query_lens=new,
        block_size=block_size,
        num_cache_blocks=num_blocks,
    )
    write_kv(k_cache, v_cache, torch.cat(new_k), torch.cat(new_v), md.slot_mapping)
    q = torch.randn(md.num_tokens, NUM_KV_HEADS * group, HEAD_DIM, dtype=dtype)
    return q, cache, md


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_cascade_matches_reference_on_random_shared_prefix_batches(any_prefix, group, block_size):
    for seed in range(6):
        rng = random.Random(seed * 1000 + group * 100 + block_size)
        torch.manual_seed(seed)
        prefix_blocks = rng.randint(1, 5)
        prefix_len = prefix_blocks * block_size
        num_seqs = rng.randint(2, 6)
        # Own cached tokens after the prefix: none, a partial block, exactly a block, several.
        computed = [
            prefix_len
            + rng.choice([0, 1, block_size - 1, block_size, rng.randint(0, 3 * block_size)])
            for _ in range(num_seqs)
        ]
        # Mixed decodes and prefill chunks over the cached prefix (suffixes of 1..several blocks).
        new = [rng.choice([1, 1, rng.randint(2, 3 * block_size)]) for _ in range(num_seqs)]
        if seed == 0:
            new = [1] * num_seqs  # the pure-decode path
        q, k_cache, v_cache, md = build_batch(
            prefix_blocks=prefix_blocks,
            block_size=block_size,
            group=group,
            computed=computed,
            new=new,
            rng=rng,
        )
        assert cascade_prefix_blocks(md) == prefix_blocks
        expected = paged_attention_ref(q, k_cache, v_cache, md, HEAD_DIM**-0.5)
        got = paged_attention(q, k_cache, v_cache, md, HEAD_DIM**-0.5)
        torch.testing.assert_close(
            got,
            expected,
            atol=1e-5,
            rtol=1e-5,
            msg=f"P={prefix_blocks} computed={computed} new={new}",
        )


@pytest.mark.parametrize(
    "computed_own,new,batched",
    [
        ([0] * 6, [32] * 6, True),  # W1's second step: equal chunks over the prefix, one call
        ([0] * 4, [1, 1, 12, 12], True),  # a served step: decodes, then equal chunks (in place)
        ([0] * 3, [12, 1, 12], True),  # equal chunks a decode apart: gathered and scattered
        ([0, 3, 1, 2], [6, 9, 7, 8], True),  # ragged chunks, some own tokens already cached
        ([0, 0, 5], [1, 12, 11], True),  # a decode beside two chunks: batched chunks + decode
        ([0, 0, 0], [2, 2, 90], False),  # padding would triple the scores: one call each
    ],
)
@pytest.mark.parametrize("group", [1, 3])
def test_prefill_chunks_are_batched_when_it_pays_and_match_the_reference(
    any_prefix, monkeypatch, computed_own, new, batched, group
):
    calls = []
    real = cascade._batched_prefill_suffix
    monkeypatch.setattr(
        cascade, "_batched_prefill_suffix", lambda *a: calls.append(len(a[4])) or real(*a)
    )
    block_size, prefix_blocks = 8, 3
    prefix_len = prefix_blocks * block_size
    torch.manual_seed(len(new) + group)
    q, k_cache, v_cache, md = build_batch(
        prefix_blocks=prefix_blocks,
        block_size=block_size,
        group=group,
        computed=[prefix_len + c for c in computed_own],
        new=new,
        rng=random.Random(7),
    )
    expected = paged_attention_ref(q, k_cache, v_cache, md, HEAD_DIM**-0.5)
    got = paged_attention(q, k_cache, v_cache, md, HEAD_DIM**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    num_chunks = sum(n > 1 for n in new)
    assert calls == ([num_chunks] if batched else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_ascending_prefix_is_read_in_place(any_prefix, monkeypatch, dtype):
    """Consecutive shared block ids: attention reads the prefix's pages as a view (no gather of
    them) and still equals the reference."""
    gathered: list[str] = []
    real_gather = cascade.gather_pages

    def recording_gather(pages, block_ids, to_dtype, name, workspace):
        gathered.append(name)
        return real_gather(pages, block_ids, to_dtype, name, workspace)

    monkeypatch.setattr(cascade, "gather_pages", recording_gather)
    for seed in range(4):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        block_size = rng.choice([8, 16])
        prefix_blocks = rng.randint(1, 5)
        num_seqs = rng.randint(2, 5)
        computed = [prefix_blocks * block_size + rng.randint(0, 2 * block_size) for _ in range(num_seqs)]
        new = [rng.choice([1, rng.randint(2, 2 * block_size)]) for _ in range(num_seqs)]
        q, k_cache, v_cache, md = build_batch(
            prefix_blocks=prefix_blocks, block_size=block_size, group=3, computed=computed,
            new=new, rng=rng, dtype=dtype, ascending_prefix=True,
        )
        gathered.clear()
        got = paged_attention(q, k_cache, v_cache, md, HEAD_DIM**-0.5)
        assert "cascade_k" not in gathered and "cascade_v" not in gathered
        expected = paged_attention_ref(q, k_cache, v_cache, md, HEAD_DIM**-0.5)
        torch.testing.assert_close(got, expected, atol=2e-2 if dtype != torch.float32 else 1e-5,
                                   rtol=2e-2 if dtype != torch.float32 else 1e-5)


def test_contiguous_run_start():
    assert cascade.contiguous_run_start(torch.tensor([7, 8, 9])) == 7
    assert cascade.contiguous_run_start(torch.tensor([4])) == 4
    assert cascade.contiguous_run_start(torch.tensor([7, 9, 10])) is None
    assert cascade.contiguous_run_start(torch.tensor([9, 8, 7])) is None
    assert cascade.contiguous_run_start(torch.tensor([], dtype=torch.int64)) is None


@pytest.mark.parametrize("use_prefix_blocks", [1, 2, 3])
def test_cascade_with_any_cached_shared_prefix_length(use_prefix_blocks):
    # Any P up to the shared, cached run is exact: the split point is free.
    rng = random.Random(use_prefix_blocks)
    q, k_cache, v_cache, md = build_batch(
        prefix_blocks=3, block_size=8, group=3, computed=[24, 30, 41], new=[1, 5, 9], rng=rng
    )
    torch.testing.assert_close(
        cascade_attention(q, k_cache, v_cache, md, use_prefix_blocks, 0.3),
        paged_attention_ref(q, k_cache, v_cache, md, 0.3),
        atol=1e-5,
        rtol=1e-5,
    )


def test_sequence_still_computing_inside_prefix_limits_the_prefix(any_prefix):
    # Sequence 0 has cached 1 block + 3 tokens of the 3 shared blocks: only the first block is
    # cached by everybody, so cascade may use 1 block at most (none if < 1 block is cached).
    rng = random.Random(7)
    q, k_cache, v_cache, md = build_batch(
        prefix_blocks=3, block_size=8, group=4, computed=[11, 24, 30], new=[20, 1, 4], rng=rng
    )
    assert cascade_prefix_blocks(md) == 1
    torch.testing.assert_close(
        paged_attention(q, k_cache, v_cache, md, 0.3),
        paged_attention_ref(q, k_cache, v_cache, md, 0.3),
        atol=1e-5,
        rtol=1e-5,
    )
    q, k_cache, v_cache, md = build_batch(
        prefix_blocks=3, block_size=8, group=4, computed=[5, 24, 30], new=[26, 1, 4], rng=rng
    )
    assert cascade_prefix_blocks(md) == 0
    torch.testing.assert_close(
        paged_attention(q, k_cache, v_cache, md, 0.3),
        paged_attention_ref(q, k_cache, v_cache, md, 0.3),
        atol=1e-5,
        rtol=1e-5,
    )


def test_no_shared_block_or_single_sequence_falls_back(any_prefix):
    rng = random.Random(3)
    for prefix_blocks, computed, new in [(0, [20, 33, 9], [1, 6, 1]), (2, [19], [5])]:
        q, k_cache, v_cache, md = build_batch(
            prefix_blocks=prefix_blocks, block_size=8, group=3, computed=computed, new=new, rng=rng
        )
        assert cascade_prefix_blocks(md) == 0
        torch.testing.assert_close(
            paged_attention(q, k_cache, v_cache, md, 0.3),
            paged_attention_ref(q, k_cache, v_cache, md, 0.3),
            atol=1e-5,
            rtol=1e-5,
        )


def test_detection_counts_leading_identical_block_columns():
    assert common_prefix_blocks(torch.tensor([[5, 6, 7, 9], [5, 6, 7, 2]]), 4) == 3
    assert common_prefix_blocks(torch.tensor([[5, 6], [4, 6]]), 2) == 0
    assert common_prefix_blocks(torch.tensor([[5, 6, 7], [5, 6, 7]]), 3) == 3
    assert common_prefix_blocks(torch.tensor([[5, 6, 7], [5, 6, 7]]), 2) == 2  # capped
    assert common_prefix_blocks(torch.tensor([[5, 6, 7], [5, 6, 7], [5, 1, 7]]), 3) == 1


def test_default_thresholds_skip_small_prefixes_and_take_the_product_workload():
    # 32 sequences over a 1,024-token shared prompt (64 blocks of 16): cascade; 2 blocks: not.
    block_size, tables = 16, []
    for s in range(32):
        tables.append(list(range(64)) + [64 + 5 * s + i for i in range(5)])
    md = AttentionMetadata.build(
        block_tables=tables,
        num_computed_tokens=[1024 + 40] * 32,
        query_lens=[1] * 32,
        block_size=block_size,
        num_cache_blocks=64 + 5 * 32,
    )
    assert cascade_prefix_blocks(md) == 64
    small = AttentionMetadata.build(
        block_tables=[[0, 1, 2 + s] for s in range(4)],
        num_computed_tokens=[40] * 4,
        query_lens=[1] * 4,
        block_size=block_size,
        num_cache_blocks=8,
    )
    assert cascade_prefix_blocks(small) == 0


def test_low_precision_cache_is_cast_like_the_reference(any_prefix):
    rng = random.Random(11)
    for dtype, tol in [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)]:
        torch.manual_seed(0)
        q, k_cache, v_cache, md = build_batch(
            prefix_blocks=2,
            block_size=8,
            group=3,
            computed=[16, 21, 30],
            new=[1, 7, 1],
            rng=rng,
            dtype=dtype,
        )
        for q_in in (
            q.float(),
            q,
        ):  # fp32 queries over a low-precision cache, and all low-precision
            got = paged_attention(q_in, k_cache, v_cache, md, 0.3)
            assert got.dtype == q_in.dtype
            expected = paged_attention_ref(q_in, k_cache, v_cache, md, 0.3)
            t = 1e-5 if q_in.dtype == torch.float32 else tol
            torch.testing.assert_close(got, expected, atol=t, rtol=t)


def test_fused_and_explicit_lse_attention_agree():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16)
    valid = torch.rand(2, 1, 5, 9) > 0.4
    valid[..., 0] = True  # every row sees a key
    for mask in (None, valid):
        o_fused, lse_fused = attention_with_lse(q, k, v, mask, 0.25)
        o_math, lse_math = attention_with_lse_math(q, k, v, mask, 0.25)
        torch.testing.assert_close(o_fused, o_math, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse_fused, lse_math, atol=1e-5, rtol=1e-5)


def _two_prefix_batch(rng: random.Random, block_size: int, group: int, new: list[int]):
    """Sequences 0-2 share one cached prefix, 3-5 another, 6 and 7 share nothing: the whole
    batch has no common prefix, groups of it do. Returns q, the one-layer cache, metadata."""
    num_blocks = 80
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    prefix_a = [ids.pop() for _ in range(3)]
    prefix_b = [ids.pop() for _ in range(2)]
    computed, tables = [], []
    for s in range(8):
        shared = prefix_a if s < 3 else prefix_b if s < 6 else []
        c = len(shared) * block_size + rng.randint(0, 2 * block_size)
        total_blocks = -(-(c + new[s]) // block_size)
        tables.append(shared + [ids.pop() for _ in range(total_blocks - len(shared))])
        computed.append(c)
    cache = PagedKVCache.allocate(
        num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM, dtype=torch.float32, device="cpu",
    )
    k_cache, v_cache = cache.k_caches[0], cache.v_caches[0]
    k_cache.normal_()  # every page random: shared blocks are shared by their ids alone
    v_cache.normal_()
    md = AttentionMetadata.build(
        block_tables=tables, num_computed_tokens=computed, query_lens=new,
        block_size=block_size, num_cache_blocks=num_blocks,
    )
    q = torch.randn(md.num_tokens, NUM_KV_HEADS * group, HEAD_DIM)
    return q, cache, md


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16])
def test_groups_sharing_different_prefixes_each_go_through_cascade(any_prefix, group, block_size):
    """Two system prompts in one batch (and two sequences with neither): no prefix is common to
    all, so each group is a cascade of its own and the rest takes the paged path; equal to the
    reference for decodes, prefill chunks and a mix."""
    from kvmemo.attention.paged import StepPlan

    for seed, new in enumerate(([1] * 8, [5, 1, 9, 1, 1, 17, 3, 1], [4, 6, 2, 7, 3, 5, 9, 2])):
        rng = random.Random(seed * 100 + group + block_size)
        torch.manual_seed(seed)
        q, cache, md = _two_prefix_batch(rng, block_size, group, new)
        k_cache, v_cache = cache.k_caches[0], cache.v_caches[0]
        assert cascade_prefix_blocks(md) == 0
        plan = StepPlan.build(md)
        assert sorted(g.prefix_blocks for g in plan.groups) == [2, 3]
        assert plan.rest is not None and plan.rest.rows.numel() == new[6] + new[7]
        expected = paged_attention_ref(q, k_cache, v_cache, md, HEAD_DIM**-0.5)
        got = paged_attention(q, k_cache, v_cache, md, HEAD_DIM**-0.5)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def kernel_calls(monkeypatch) -> list[bool]:
    """Per decode-kernel write_and_decode call this step, whether it started from a prefix's
    attention."""
    from kvmemo.attention.kernels.paged_decode import DecodeKernel

    calls: list[bool] = []
    real = DecodeKernel.write_and_decode

    def recording(self, *args, **kwargs):
        calls.append(kwargs.get("prefix") is not None)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DecodeKernel, "write_and_decode", recording)
    return calls


def _decode_step(q: torch.Tensor, cache: PagedKVCache, md: AttentionMetadata,
                 calls: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's forward over a step whose new K/V the build already wrote: the slots are
    zeroed first, so the step must write them itself (checked). Returns (got, the reference)."""
    from kvmemo.attention.backend import PagedAttentionBackend

    k_cache, v_cache = cache.k_caches[0], cache.v_caches[0]
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [slots, Hkv, D] views
    new_k, new_v = flat_k[md.slot_mapping].clone(), flat_v[md.slot_mapping].clone()
    expected = paged_attention_ref(q, k_cache, v_cache, md, HEAD_DIM**-0.5)
    flat_k[md.slot_mapping] = 0
    flat_v[md.slot_mapping] = 0
    calls.clear()
    got = PagedAttentionBackend(HEAD_DIM**-0.5, batch_invariant=False).forward(
        0, q, new_k, new_v, cache, md)
    assert torch.equal(flat_k[md.slot_mapping], new_k)
    assert torch.equal(flat_v[md.slot_mapping], new_v)
    return got, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ascending", [True, False])
def test_a_decode_step_over_a_shared_prefix_writes_attends_and_merges_in_one_call(
    any_prefix, decode_path, kernel_calls, dtype, ascending
):
    """A step where every sequence decodes over a cascade prefix: the backend computes the
    prefix's attention, then one decode-kernel call writes each new K/V into its slot and attends
    over the sequence's own keys from the prefix's state. Equals the reference (which writes
    first, then attends over all keys), and the K/V land in their slots."""
    for seed in range(4):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        block_size = rng.choice([8, 16])
        prefix_blocks = rng.randint(1, 4)
        num_seqs = rng.randint(2, 6)
        computed = [prefix_blocks * block_size + rng.randint(0, 2 * block_size)
                    for _ in range(num_seqs)]
        q, cache, md = build_cascade_batch(
            prefix_blocks=prefix_blocks, block_size=block_size, group=3, computed=computed,
            new=[1] * num_seqs, rng=rng, dtype=dtype, ascending_prefix=ascending,
        )
        got, expected = _decode_step(q, cache, md, kernel_calls)
        assert kernel_calls == ([True] if decode_path == "kernel" else [])
        assert got.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_a_decode_step_in_prefix_groups_writes_and_attends_per_group(any_prefix, decode_path,
                                                                     kernel_calls):
    """Every sequence decodes, in two prefix groups and a rest with no shared prefix: one
    decode-kernel call per group (from its prefix's state) and one for the rest; equal to the
    reference, with every new K/V in its slot."""
    for seed in range(3):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        q, cache, md = _two_prefix_batch(rng, 8, 3, [1] * 8)
        got, expected = _decode_step(q, cache, md, kernel_calls)
        assert sorted(kernel_calls) == ([False, True, True] if decode_path == "kernel" else [])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
