"""Sliding-window layers: both backends equal dense attention whose query at position p sees
only keys p - window < k <= p, on mixed batches whose tables were cropped to the window (and
whose slid-out entries were released), for windows shorter and longer than a block."""

from __future__ import annotations

import random

import pytest
import torch

from kvmemo.attention.backend import PagedAttentionBackend, ReferenceAttentionBackend
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.kv.layout import first_window_block
from tests.attention.paged_testing import HEAD_DIM, make_batch

pytestmark = pytest.mark.usefixtures("decode_path")  # kernel and gather decodes

SCALE = HEAD_DIM**-0.5


def dense_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int
) -> torch.Tensor:
    """q [Lq, Hq, D] at the last Lq of Lk positions; k, v [Lk, Hkv, D]; written out in full."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    lq, lk = q.shape[0], k.shape[0]
    q_pos = torch.arange(lk - lq, lk)[:, None]
    k_pos = torch.arange(lk)[None, :]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * SCALE
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def windowed(batch, window: int, release: bool) -> AttentionMetadata:
    """The batch's metadata for a sliding layer; with release, table entries before the window
    are None, as a sliding group's tables are once its blocks slid out."""
    md = batch.metadata
    rows = md.block_tables.tolist()
    tables = [row[: -(-s // md.block_size)] for row, s in zip(rows, md.seq_lens)]
    computed = [s - q for s, q in zip(md.seq_lens, md.query_lens)]
    if release:
        firsts = [first_window_block(c, md.block_size, window) for c in computed]
        tables = [[None] * f + t[f:] for t, f in zip(tables, firsts)]
    return AttentionMetadata.build(
        block_tables=tables, num_computed_tokens=computed, query_lens=md.query_lens,
        block_size=md.block_size, num_cache_blocks=md.num_cache_blocks, sliding_window=window,
    )


def check(batch, window: int, release: bool, atol: float = 2e-5) -> None:
    md = batch.metadata
    expected = torch.cat([
        dense_window_attention(
            batch.q[md.query_start_loc[s] : md.query_start_loc[s + 1]],
            batch.stored(batch.full_k[s], "k"), batch.stored(batch.full_v[s], "v"), window,
        )
        for s in range(md.num_seqs)
    ])
    metadata = windowed(batch, window, release)
    for backend in (PagedAttentionBackend(SCALE), PagedAttentionBackend(SCALE, False),
                    ReferenceAttentionBackend(SCALE)):
        got = backend.forward(0, batch.q, batch.new_k, batch.new_v, batch.cache, metadata)
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol,
                                   msg=lambda m: f"{backend.name} window {window}: {m}")


@pytest.mark.parametrize("window", [1, 5, 8, 13, 40])
@pytest.mark.parametrize("release", [False, True])
def test_mixed_batches_match_dense_window(window: int, release: bool) -> None:
    for seed in range(5):
        rng = random.Random(seed * 100 + window)
        num_seqs = rng.randint(1, 5)
        cached = [rng.choice([0, 3, 8, 17, rng.randint(0, 60)]) for _ in range(num_seqs)]
        new = [rng.choice([1, 1, rng.randint(1, 20)]) for _ in range(num_seqs)]
        batch = make_batch(cached=cached, new=new, group=rng.choice([1, 3]), block_size=8, seed=seed)
        check(batch, window, release)


@pytest.mark.parametrize("window", [4, 16, 33])
def test_all_decode_batch(window: int) -> None:
    cached = [0, 3, 15, 16, 17, 31, 64, 70]
    batch = make_batch(cached=cached, new=[1] * len(cached), group=4, block_size=16, seed=7)
    check(batch, window, release=True)


def test_a_window_wider_than_every_context_is_plain_causal() -> None:
    batch = make_batch(cached=[5, 20], new=[1, 9], group=2, block_size=8, seed=1)
    check(batch, window=1000, release=False)
    assert windowed(batch, 1000, False).block_tables.shape == batch.metadata.block_tables.shape


def test_a_released_block_inside_the_window_is_an_error() -> None:
    """Position 30 sees 23..30 through a window of 8: block 2 (16..23) must still be there."""
    AttentionMetadata.build(
        block_tables=[[None, None, 2, 3]], num_computed_tokens=[30], query_lens=[1],
        block_size=8, num_cache_blocks=8, sliding_window=8,
    )
    with pytest.raises(ValueError, match="released"):
        AttentionMetadata.build(
            block_tables=[[None, None, None, 3]], num_computed_tokens=[30], query_lens=[1],
            block_size=8, num_cache_blocks=8, sliding_window=8,
        )
