"""The decode kernel's vector path (kernels/row_chunks.h), at the head sizes that take it (64,
128, 256; test_invariant.py's head size 16 takes the scalar loops): a query's bits are the same
whether its keys were scored in rows (decode's few rows), transposed into lanes for its group of
rows, or packed once for every group of its sequence, in whatever register block it ran; and its
values are dense causal attention's."""

from __future__ import annotations

import pytest
import torch

from kvmemo.attention.backend import PagedAttentionBackend
from kvmemo.attention.kernels.paged_decode import load_decode_kernel
from kvmemo.attention.metadata import AttentionMetadata
from tests.attention.paged_testing import make_batch

pytestmark = pytest.mark.skipif(load_decode_kernel() is None, reason="no C compiler")

CACHED, PROMPT = 90, 150  # 240 keys: chunks of 64 cut mid-prompt; rows in groups of up to 32


def _run(batch, chunks: list[int], head_dim: int, window: int | None = None) -> torch.Tensor:
    """The prompt's queries fed in `chunks` after the cached keys: [PROMPT, Hq, D]."""
    table = batch.metadata.block_tables[0].tolist()
    backend, outs, start = PagedAttentionBackend(head_dim**-0.5), [], 0
    for n in chunks:
        md = AttentionMetadata.build(
            block_tables=[table], num_computed_tokens=[CACHED + start], query_lens=[n],
            block_size=batch.metadata.block_size, num_cache_blocks=batch.cache.num_blocks,
            sliding_window=window)
        k = batch.new_k[start:start + n]
        v = batch.new_v[start:start + n]
        outs.append(backend.forward(0, batch.q[start:start + n].contiguous(), k, v,
                                    batch.cache, md))
        start += n
    return torch.cat(outs)


def _dense(batch, head_dim: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over keys 0 (or the window's first) .. CACHED + i for prompt
    row i, in float64, from the keys and values as the pages hold them."""
    k = batch.full_k[0].to(dtype).double()
    v = batch.full_v[0].to(dtype).double()
    group = batch.q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", batch.q.double(), k) * head_dim**-0.5
    keys = torch.arange(CACHED + PROMPT)
    last = (CACHED + torch.arange(PROMPT))[:, None]
    visible = (keys[None, :] <= last) & (keys[None, :] > last - (window or len(keys)))
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_a_query_is_the_same_bits_in_rows_lanes_and_packs(head_dim, group, block_size, dtype):
    batch = make_batch(cached=[CACHED], new=[PROMPT], group=group, block_size=block_size,
                       dtype=dtype, num_kv_heads=2, seed=head_dim + group + block_size,
                       head_dim=head_dim)
    whole = _run(batch, [PROMPT], head_dim)  # groups of rows; long ones packed
    torch.testing.assert_close(whole.double(), _dense(batch, head_dim, dtype), rtol=2e-5,
                               atol=2e-5)
    for chunks in ([1] * PROMPT, [7, 64, 79], [33, 2, 115]):  # decode rows, odd groups, blocks
        assert torch.equal(_run(batch, chunks, head_dim), whole), chunks


@pytest.mark.parametrize("head_dim", [64, 256])
def test_a_windowed_query_is_the_same_bits_in_any_step(head_dim):
    """A sliding window of 100 keys (mid-page starts): the row's chunks start at its own first
    key, whatever step computes it."""
    batch = make_batch(cached=[CACHED], new=[PROMPT], group=3, block_size=16, head_dim=head_dim)
    whole = _run(batch, [PROMPT], head_dim, window=100)
    torch.testing.assert_close(whole.double(), _dense(batch, head_dim, torch.float32, window=100),
                               rtol=2e-5, atol=2e-5)
    for chunks in ([1] * PROMPT, [7, 64, 79]):
        assert torch.equal(_run(batch, chunks, head_dim, window=100), whole), chunks
