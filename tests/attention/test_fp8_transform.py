"""The fp8 transform (offset, rotation, scale): exact for attention on every path, worth its keep
on biased data, and calibrated from attention-weighted statistics. No model needed."""

from __future__ import annotations

import random

import pytest
import torch

from kvmemo.attention import cascade
from kvmemo.attention.backend import PagedAttentionBackend, ReferenceAttentionBackend
from kvmemo.attention.cache import FP8_DTYPE, FP8_MAX, PagedKVCache
from kvmemo.attention.cascade import cascade_prefix_blocks
from kvmemo.attention.fp8 import calibrate_kv_scales, hadamard_rotation, scales_from_amax
from kvmemo.attention.metadata import AttentionMetadata
from tests.attention.paged_testing import dense_attention

pytestmark = pytest.mark.usefixtures("decode_path")  # kernel and gather decodes

HEAD_DIM, NUM_KV_HEADS, GROUP, BLOCK_SIZE = 16, 2, 3, 8
SCALE = HEAD_DIM**-0.5


def biased(num_tokens: int, bias: float) -> torch.Tensor:
    """[T, Hkv, D] noise plus a large per-channel bias, like RoPE'd keys' slow channels."""
    offset = torch.zeros(NUM_KV_HEADS, HEAD_DIM)
    offset[:, :4] = bias * torch.tensor([1.0, -0.7, 0.5, 1.3])
    return torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM) + offset


def transformed_cache(
    num_blocks: int, k: torch.Tensor, v: torch.Tensor, smooth: bool, rotate: bool
) -> PagedKVCache:
    """An fp8 cache whose transform fits k/v [N, Hkv, D]: offsets = means (if smooth), Hadamard
    rotation (if rotate), scales from the transformed maxima."""
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                  num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=FP8_DTYPE, device="cpu")
    rotation = hadamard_rotation(HEAD_DIM) if rotate else torch.eye(HEAD_DIM)
    k_mu = k.mean(0) if smooth else torch.zeros(NUM_KV_HEADS, HEAD_DIM)
    v_mu = v.mean(0) if smooth else torch.zeros(NUM_KV_HEADS, HEAD_DIM)
    k_amax = ((k - k_mu) @ rotation).abs().amax(dim=(0, 2))
    v_amax = ((v - v_mu) @ rotation).abs().amax(dim=(0, 2))
    cache.set_scales(scales_from_amax(k_amax)[None], scales_from_amax(v_amax)[None],
                     k_offsets=k_mu[None], v_offsets=v_mu[None], rotation=rotation)
    return cache


def shared_prefix_step(cached: list[int], new: list[int], bias: float, smooth: bool, rotate: bool, seed: int):
    """Sequences sharing their first 2 physical blocks; cached K/V written through the cache.

    Returns (cache, metadata, q, new k, new v, per-sequence full-precision k and v).
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    prefix = 2 * BLOCK_SIZE
    num_blocks = 2 + sum(-(-(c + n) // BLOCK_SIZE) - 2 for c, n in zip(cached, new)) + 1
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    shared = [ids.pop() for _ in range(2)]
    tables = [shared + [ids.pop() for _ in range(-(-(c + n) // BLOCK_SIZE) - 2)] for c, n in zip(cached, new)]
    shared_k, shared_v = biased(prefix, bias), biased(prefix, bias / 3)
    full_k = [torch.cat([shared_k, biased(c + n - prefix, bias)]) for c, n in zip(cached, new)]
    full_v = [torch.cat([shared_v, biased(c + n - prefix, bias / 3)]) for c, n in zip(cached, new)]
    cache = transformed_cache(num_blocks, torch.cat(full_k), torch.cat(full_v), smooth, rotate)
    for table, c, k, v in zip(tables, cached, full_k, full_v):
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c)])
        cache.write(0, k[:c], v[:c], slots)
    md = AttentionMetadata.build(block_tables=tables, num_computed_tokens=cached, query_lens=new,
                                 block_size=BLOCK_SIZE, num_cache_blocks=num_blocks)
    q = torch.randn(md.num_tokens, NUM_KV_HEADS * GROUP, HEAD_DIM) * 2
    new_k = torch.cat([k[c:] for k, c in zip(full_k, cached)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, cached)])
    return cache, md, q, new_k, new_v, full_k, full_v


def stored_values(cache: PagedKVCache, table: list[int], length: int, which: str) -> torch.Tensor:
    """What the pages hold for one sequence, decoded by hand: byte * scale @ rotation.T + offset."""
    pages = cache.k_caches[0] if which == "k" else cache.v_caches[0]  # [nb, bs, Hkv, D]
    raw = pages[table].flatten(0, 1)[:length].float()  # [L, Hkv, D]
    scales = (cache.k_scales if which == "k" else cache.v_scales)[0]
    offsets = (cache.k_offsets if which == "k" else cache.v_offsets)[0]
    return (raw * scales[:, None]) @ cache.rotation.T + offsets


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("use_cascade", [False, True])
@pytest.mark.parametrize("new", [[1, 7, 1], [1, 1, 1]])
def test_offsets_and_rotation_are_exact_on_every_attention_path(monkeypatch, use_cascade, new, rotate):
    """Paged (batched decode, kernel or gather; prefill; cascade) == reference == dense attention
    over the decoded pages, with a large per-channel bias the offsets remove."""
    if use_cascade:
        monkeypatch.setattr(cascade, "MIN_PREFIX_TOKENS", 1)
        monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", 1)
    cached = [16, 21, 30]
    cache, md, q, new_k, new_v, _, _ = shared_prefix_step(cached, new, bias=40.0, smooth=True, rotate=rotate, seed=3)
    assert bool(cascade_prefix_blocks(md)) == use_cascade
    assert float(cache.k_offsets.abs().max()) > 20
    assert torch.equal(cache.rotation, torch.eye(HEAD_DIM)) != rotate
    got = PagedAttentionBackend(SCALE).forward(0, q, new_k, new_v, cache, md)
    ref = ReferenceAttentionBackend(SCALE).forward(0, q, new_k, new_v, cache, md)  # rewrites same bytes
    expected = []
    for s in range(md.num_seqs):
        start, end = md.query_start_loc[s], md.query_start_loc[s + 1]
        table, length = md.block_tables[s].tolist(), md.seq_lens[s]
        k, v = stored_values(cache, table, length, "k"), stored_values(cache, table, length, "v")
        expected.append(dense_attention(q[start:end], k, v, SCALE))
    torch.testing.assert_close(ref, torch.cat(expected), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rotate", [False, True])
def test_offsets_shrink_the_error_on_biased_kv(rotate):
    """Against full-precision K/V the offset cache's error is far below scales-only."""
    errors = {}
    for smooth in (False, True):
        cache, md, q, new_k, new_v, full_k, full_v = shared_prefix_step(
            [16, 21, 30], [1, 7, 1], bias=40.0, smooth=smooth, rotate=smooth and rotate, seed=5)
        got = PagedAttentionBackend(SCALE).forward(0, q, new_k, new_v, cache, md)
        exact = torch.cat([
            dense_attention(q[md.query_start_loc[s]:md.query_start_loc[s + 1]], full_k[s], full_v[s], SCALE)
            for s in range(md.num_seqs)])
        errors[smooth] = float((got - exact).abs().mean() / (exact - exact.mean(0)).abs().mean())
    assert errors[True] < errors[False] / 4, errors  # measured 0.05 vs 0.59


def test_hadamard_rotation_is_orthogonal_deterministic_and_signed():
    r = hadamard_rotation(64)
    torch.testing.assert_close(r @ r.T, torch.eye(64), atol=1e-6, rtol=0)
    assert torch.equal(r, hadamard_rotation(64))
    assert set(r.abs().unique().tolist()) == {0.125}  # every channel gets 1/8 of every input
    assert 0 < int((r[:, 0] > 0).sum()) < 64  # signed rows: a constant input does not stay in one channel
    assert torch.equal(hadamard_rotation(48), torch.eye(48))  # not a power of two: identity


class SinkModel(torch.nn.Module):
    """One layer, one kv head: every query points at key 0 (an attention sink), whose K/V lack the
    bias all other keys share. calibrate_kv_scales only needs model(ids, positions, attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # for the device lookup
        g = torch.Generator().manual_seed(0)
        self.sink_k = torch.randn(HEAD_DIM, generator=g)
        self.sink_v = torch.randn(HEAD_DIM, generator=g) * 0.1
        self.bias = torch.full((HEAD_DIM,), 5.0)
        self.noise = torch.randn(64, 3, HEAD_DIM, generator=g)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        n = len(ids)
        k = (self.bias + self.noise[:n, 0]).clone()
        v = (self.bias + self.noise[:n, 1]).clone()
        k[0], v[0] = self.sink_k, self.sink_v
        q = (self.sink_k * 10 + self.noise[:n, 2] * 0.1)[:, None]  # scores favour key 0 by far
        return attention(0, q, k[:, None], v[:, None])


def test_calibrated_offsets_follow_the_attention_not_the_plain_mean():
    model = SinkModel()
    got = calibrate_kv_scales(model, [list(range(40)), list(range(25))], num_layers=1, num_kv_heads=1)
    # every query gives ~all its weight to the sink: the offsets land on the sink's K and V
    torch.testing.assert_close(got.k_offset[0, 0], model.sink_k, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got.v_offset[0, 0], model.sink_v, atol=1e-3, rtol=1e-3)
    assert torch.equal(got.rotation, torch.eye(HEAD_DIM))  # the default: no rotation
    rotated = calibrate_kv_scales(model, [list(range(40)), list(range(25))], 1, 1, rotate=True)
    assert torch.equal(rotated.rotation, hadamard_rotation(HEAD_DIM))
    assert torch.equal(rotated.k_offset, got.k_offset) and rotated.digest() != got.digest()
    # scales are powers of two that cover the offset, rotated calibration values with headroom
    k = torch.cat([model.noise[:40, 0], model.noise[:25, 0]]) + model.bias
    k[0] = k[40] = model.sink_k
    amax = float(((k - got.k_offset[0, 0]) @ got.rotation).abs().max())
    scale = float(got.k[0, 0])
    assert scale == 2.0 ** round(torch.log2(got.k[0, 0]).item())
    assert amax * 1.5 <= scale * FP8_MAX < amax * 3
    plain = calibrate_kv_scales(model, [list(range(40))], 1, 1, smooth=False)
    assert not plain.k_offset.any() and torch.equal(plain.rotation, torch.eye(HEAD_DIM))
    assert plain.digest() != got.digest()
    with pytest.raises(ValueError, match="non-empty"):
        calibrate_kv_scales(model, [[]], 1, 1)
