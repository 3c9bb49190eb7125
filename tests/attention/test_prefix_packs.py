"""A decode step's packed shared prefix is kept across steps exactly while its blocks' allocation
generations stand, and attention over it equals the reference every step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmemo.attention import cascade, fused_decode
from kvmemo.attention.backend import PagedAttentionBackend
from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.kernels.flash_attention import pack_kv
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.attention.prefix_packs import PrefixPacks
from kvmemo.attention.torch_ref import paged_attention_ref
from kvmemo.kv.block_pool import BlockPool

BLOCK, PREFIX_BLOCKS, SEQS, KV_HEADS, GROUP, DIM = 16, 4, 4, 2, 3, 64
SCALE = DIM**-0.5


@pytest.fixture
def packs_calls(monkeypatch):
    """Cascade for this small prefix; counts pack_kv calls; skips without the flash kernel."""
    if pack_kv(torch.zeros(1, 1, 1, DIM), torch.zeros(1, 1, 1, DIM)) is None:
        pytest.skip("the flash kernel does not run here (no compiler or no AVX-512)")
    monkeypatch.setattr(cascade, "MIN_PREFIX_TOKENS", 1)
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", 1)
    calls = []
    real = fused_decode.pack_kv
    monkeypatch.setattr(fused_decode, "pack_kv", lambda k, v: calls.append(1) or real(k, v))
    return calls


def decode_step(backend, cache, own_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence over the shared prefix (blocks 0..3) and its own block
    (4 + s): the backend's output and the reference's (after the same K/V write)."""
    tables = [list(range(PREFIX_BLOCKS)) + [PREFIX_BLOCKS + s] for s in range(SEQS)]
    computed = [PREFIX_BLOCKS * BLOCK + n for n in own_lens]
    metadata = AttentionMetadata.build(
        block_tables=tables, num_computed_tokens=computed, query_lens=[1] * SEQS,
        block_size=BLOCK, num_cache_blocks=cache.num_blocks)
    q = torch.randn(SEQS, KV_HEADS * GROUP, DIM)
    k, v = torch.randn(SEQS, KV_HEADS, DIM), torch.randn(SEQS, KV_HEADS, DIM)
    got = backend.forward(0, q, k, v, cache, metadata)
    expected = paged_attention_ref(q, *cache.logical_caches(0), metadata, SCALE)
    return got, expected


def test_the_prefix_is_packed_once_and_repacked_when_a_block_is_handed_out_again(packs_calls):
    torch.manual_seed(0)
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=PREFIX_BLOCKS + SEQS, block_size=BLOCK,
                                  num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.float32,
                                  device="cpu")
    for pages in (cache.k_pages[0], cache.v_pages[0]):
        pages.copy_(torch.randn_like(pages))
    pool = BlockPool(PREFIX_BLOCKS + SEQS)
    backend = PagedAttentionBackend(SCALE, batch_invariant=False)  # cascade's packs
    backend.prefix_packs.generations = pool.generations

    for step in range(3):  # the same prefix step after step: packed at the first only
        got, expected = decode_step(backend, cache, [3 + step] * SEQS)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(packs_calls) == 1

    # Block 2 holds new tokens without the pool handing it out: the kept pack is stale, and the
    # step reads it (this is what the generation rule exists for).
    for pages in (cache.k_pages[0], cache.v_pages[0]):
        pages[:, 2].copy_(torch.randn_like(pages[:, 2]))
    got, expected = decode_step(backend, cache, [6] * SEQS)
    assert not torch.allclose(got, expected, rtol=1e-3, atol=1e-3)

    # Handed out again (as a block is before any new content): packed anew, right again.
    pool.get_new_blocks(PREFIX_BLOCKS + SEQS)
    got, expected = decode_step(backend, cache, [7] * SEQS)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(packs_calls) == 2


def test_without_generations_nothing_is_kept(packs_calls):
    torch.manual_seed(1)
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=PREFIX_BLOCKS + SEQS, block_size=BLOCK,
                                  num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.bfloat16,
                                  device="cpu")
    backend = PagedAttentionBackend(SCALE, batch_invariant=False)  # no pool generations
    for step in range(2):
        got, expected = decode_step(backend, cache, [2 + step] * SEQS)
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert packs_calls == [] and backend.prefix_packs.nbytes == 0


def test_block_generations_count_hand_outs_not_cache_hits():
    pool = BlockPool(4)
    first = pool.get_new_blocks(2)
    assert pool.generations == [1, 1, 0, 0]
    pool.free_blocks(first)
    pool.touch([first[0]])  # a cache hit takes a block back with its content
    assert pool.generations == [1, 1, 0, 0]
    pool.get_new_blocks(3)  # blocks 1-3 (block 0 is held)
    assert pool.generations == [1, 2, 1, 1]
    pool.free_blocks([first[0]])
    # Adopted as a partial-reuse source: its first slots are kept, the rest rewritten.
    pool.take_free_block(first[0])
    assert pool.generations == [2, 2, 1, 1]


def test_packs_drop_what_a_step_no_longer_uses_and_respect_their_budget():
    generations = [0] * 8
    packs = PrefixPacks(generations=generations, max_bytes=3000)
    pages = torch.zeros(4)
    a, b = packs.key(pages, torch.float32, [0, 1]), packs.key(pages, torch.float32, [2, 3])
    assert a is not None and b is not None and a != b
    packed = pack_kv(torch.randn(1, 1, 2, DIM), torch.randn(1, 1, 2, DIM))
    if packed is None:
        pytest.skip("the flash kernel does not run here")
    assert packed.nbytes == 2 * 64 * DIM * 4  # one padded tile of K and of V
    small = dataclasses.replace(packed, k=packed.k[:1500], v=packed.v[:1500])  # 3,000 bytes
    packs.put(0, a, small)
    packs.put(0, b, small)  # over the budget: not kept
    assert packs.get(0, a) is small and packs.get(0, b) is None
    generations[1] += 1
    assert packs.key(pages, torch.float32, [0, 1]) != a  # a block handed out: another key
    packs.retain({b})
    assert packs.get(0, a) is None and packs.nbytes == 0
    assert PrefixPacks().key(pages, torch.float32, [0]) is None  # no generations: never kept

