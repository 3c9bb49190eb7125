"""The Triton kernels (KV write, paged attention) against the torch reference.

Without a GPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a
GPU the same tests run the compiled kernels on the device. The oracle is the reference backend
(torch_ref.paged_attention_ref) over the same pages, in fp32.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvmemo.attention.backend import (
    PagedAttentionBackend,
    ReferenceAttentionBackend,
    select_attention_backend,
)
from kvmemo.attention.cache import FP8_DTYPE, PagedKVCache
from kvmemo.attention.fp8 import scales_from_amax
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.triton_support import triton_unavailable_reason

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_reason = triton_unavailable_reason(DEVICE)
pytestmark = [
    pytest.mark.skipif(_reason is not None, reason=f"Triton kernels cannot run: {_reason}"),
    # The interpreter runs NumPy, not the ISA-specific kernels: once per `make test` is enough.
    pytest.mark.native_isa_only,
]

# Tolerances against the fp32 reference: fp32 kernels accumulate in another order; bf16 and fp16
# round the query, keys and probabilities as flash attention does.
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def triton_backend(scale: float, split: bool | None = None):
    from kvmemo.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(scale, split=split)


def build_step(
    *, cached: list[int], new: list[int], group: int, block_size: int, head_dim: int,
    kv_dtype: torch.dtype = torch.float32, num_kv_heads: int = 2, window: int | None = None,
    seed: int = 0,
):
    """A cache with `cached` tokens per sequence already written (shuffled pages), this step's
    q/k/v for `new` tokens each, and the step's metadata; fp8 caches get calibrated scales and
    non-zero offsets."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in zip(cached, new)) + 2
    cache = PagedKVCache.allocate(
        num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=kv_dtype, device=DEVICE,
    )
    full_k = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) + 0.5 for c, n in zip(cached, new)]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in zip(cached, new)]
    if cache.is_fp8:
        k_amax = torch.stack([(k - 0.5).abs().amax(dim=(0, 2)) for k in full_k]).amax(0)
        v_amax = torch.stack([v.abs().amax(dim=(0, 2)) for v in full_v]).amax(0)
        offsets = torch.full((1, num_kv_heads, head_dim), 0.5)
        cache.set_scales(
            scales_from_amax(k_amax)[None].to(DEVICE), scales_from_amax(v_amax)[None].to(DEVICE),
            k_offsets=offsets.to(DEVICE),
        )
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in zip(cached, new)]
    for table, c, k, v in zip(tables, cached, full_k, full_v):
        if c:
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                                  for p in range(c)], device=DEVICE)
            cache.write(0, k[:c].to(DEVICE), v[:c].to(DEVICE), slots)
    metadata = AttentionMetadata.build(
        block_tables=tables, num_computed_tokens=cached, query_lens=new, block_size=block_size,
        num_cache_blocks=num_blocks, device=DEVICE, sliding_window=window,
    )
    q = torch.randn(sum(new), num_kv_heads * group, head_dim, generator=gen)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, cached)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, cached)])
    return cache, metadata, q.to(DEVICE), new_k.to(DEVICE), new_v.to(DEVICE)


def clone_cache(cache: PagedKVCache) -> PagedKVCache:
    copy = PagedKVCache(
        k_pages=[p.clone() for p in cache.k_pages], v_pages=[p.clone() for p in cache.v_pages],
        block_size=cache.block_size,
    )
    if cache.is_fp8:
        copy.k_scales, copy.v_scales = cache.k_scales.clone(), cache.v_scales.clone()
        copy.k_offsets, copy.v_offsets = cache.k_offsets.clone(), cache.v_offsets.clone()
        copy.rotation = cache.rotation.clone()
    return copy


def run_and_reference(step, q_dtype: torch.dtype, split: bool | None = None):
    """(Triton's output, the reference's fp32 output, both caches after the step's write)."""
    cache, metadata, q, k, v = step
    scale = q.shape[-1] ** -0.5
    ref_cache = clone_cache(cache)
    out = triton_backend(scale, split).forward(
        0, q.to(q_dtype), k.to(q_dtype), v.to(q_dtype), cache, metadata)
    # The oracle reads the same stored K/V (written by the paged backend's own write) in fp32.
    expected = ReferenceAttentionBackend(scale).forward(
        0, q.to(q_dtype).float(), k.to(q_dtype).float(), v.to(q_dtype).float(), ref_cache,
        metadata)
    return out, expected, cache, ref_cache


# Mixed batches: a fresh prompt, decodes at odd lengths (one across several 256-key segments),
# and a prompt chunk over a cached prefix.
MIXED = dict(cached=[0, 37, 300, 5], new=[9, 1, 1, 20])


@pytest.mark.parametrize(
    "group, block_size, head_dim",
    [(1, 16, 64), (3, 16, 128), (4, 32, 256), (8, 32, 64), (3, 32, 64), (8, 16, 128),
     (1, 32, 256), (4, 16, 64)],
)
def test_mixed_batch_equals_reference(group: int, block_size: int, head_dim: int) -> None:
    step = build_step(**MIXED, group=group, block_size=block_size, head_dim=head_dim)
    out, expected, cache, ref_cache = run_and_reference(step, torch.float32)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=1e-4)
    # The KV write put this step's keys and values where the reference's write put them.
    assert torch.equal(cache.k_pages[0], ref_cache.k_pages[0])
    assert torch.equal(cache.v_pages[0], ref_cache.v_pages[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pages(dtype: torch.dtype) -> None:
    step = build_step(**MIXED, group=4, block_size=16, head_dim=64, kv_dtype=dtype, seed=1)
    out, expected, cache, ref_cache = run_and_reference(step, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=2e-2)
    assert torch.equal(cache.k_pages[0], ref_cache.k_pages[0])


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_fp8_pages_with_offsets_and_scales(q_dtype: torch.dtype) -> None:
    """fp8_e4m3 pages: the write quantises with the calibrated offset and scale (the same bytes
    the paged backend writes) and attention reads them through the folded query."""
    step = build_step(**MIXED, group=3, block_size=16, head_dim=64, kv_dtype=FP8_DTYPE, seed=2)
    out, expected, cache, ref_cache = run_and_reference(step, q_dtype)
    assert torch.equal(cache.k_pages[0].view(torch.uint8), ref_cache.k_pages[0].view(torch.uint8))
    assert torch.equal(cache.v_pages[0].view(torch.uint8), ref_cache.v_pages[0].view(torch.uint8))
    tolerance = ATOL[torch.float32] * 10 if q_dtype == torch.float32 else ATOL[q_dtype]
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=2e-2)


@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_sliding_window(window: int) -> None:
    """Tables cropped to the window (AttentionMetadata.build), windows shorter and longer than a
    block, in prompt chunks and decodes."""
    step = build_step(cached=[0, 50, 70, 3], new=[30, 1, 12, 1], group=2, block_size=16,
                      head_dim=64, window=window, seed=3)
    out, expected, _, _ = run_and_reference(step, torch.float32)
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=1e-4)


def test_split_is_the_same_bits() -> None:
    """Split mode (one program per 256-key segment, then a reduction) and one program per tile
    merge the same segment states in the same order: the same bits, in prefill and decode."""
    step = build_step(cached=[600, 5, 290], new=[1, 40, 3], group=4, block_size=16,
                      head_dim=64, seed=4)
    cache, metadata, q, k, v = step
    whole = triton_backend(0.125, split=False).forward(0, q, k, v, clone_cache(cache), metadata)
    split = triton_backend(0.125, split=True).forward(0, q, k, v, clone_cache(cache), metadata)
    assert torch.equal(whole, split)


def test_batch_invariance() -> None:
    """A sequence's output alone equals its rows in a batch with others, bit for bit."""
    step = build_step(cached=[0, 300, 33], new=[17, 1, 4], group=3, block_size=16,
                      head_dim=64, seed=5)
    cache, metadata, q, k, v = step
    batch = triton_backend(0.125).forward(0, q, k, v, clone_cache(cache), metadata)
    for s in range(metadata.num_seqs):
        rows = metadata.query_rows([s])
        alone = triton_backend(0.125).forward(
            0, q[rows], k[rows], v[rows], clone_cache(cache), metadata.subset([s]))
        assert torch.equal(alone, batch[rows]), f"sequence {s} changed with its batch"


def test_auto_backend_and_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = select_attention_backend("auto", 1.0, "cpu")
    assert isinstance(backend, PagedAttentionBackend)  # CPU serves with its own kernels
    assert select_attention_backend("triton", 1.0, DEVICE).name == "triton"
    with pytest.raises(ValueError, match="must be one of"):
        select_attention_backend("flash", 1.0)
    step = build_step(cached=[0], new=[3], group=1, block_size=16, head_dim=64)
    cache, metadata, q, k, v = step
    odd = PagedKVCache.allocate(num_layers=1, num_blocks=4, block_size=12, num_kv_heads=2,
                                head_dim=64, dtype=torch.float32, device=DEVICE)
    md = AttentionMetadata.build(block_tables=[[0]], num_computed_tokens=[0], query_lens=[3],
                                 block_size=12, num_cache_blocks=4, device=DEVICE)
    with pytest.raises(ValueError, match="power-of-two block_size"):
        triton_backend(1.0).forward(0, q, k, v, odd, md)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            select_attention_backend("triton", 1.0, "cpu")


def test_gpu_key_steps_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU reads 64 keys per online-softmax step (four 16-token pages, gathered through the
    block table); the interpreter reads 16 by default. Forced here: the same answer."""
    from kvmemo.attention.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "keys_per_step", lambda block_size, device: 64)
    step = build_step(**MIXED, group=3, block_size=16, head_dim=64, seed=6)
    out, expected, _, _ = run_and_reference(step, torch.float32)
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=1e-4)
