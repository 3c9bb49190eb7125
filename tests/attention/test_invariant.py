"""Batch-invariant attention (attention/invariant.py): a query's output is the same bits however
the step around it is made: its prompt in one pass or in chunks, other sequences beside it or
none, a decode step or the last row of a prefill, fp32, bf16 or fp8 pages. The values are
checked against dense attention in test_backends.py; here only the bits' independence."""

from __future__ import annotations

import pytest
import torch

from kvmemo.attention.backend import PagedAttentionBackend
from kvmemo.attention.cache import FP8_DTYPE
from kvmemo.attention.kernels.paged_decode import load_decode_kernel
from kvmemo.attention.metadata import AttentionMetadata
from tests.attention.paged_testing import HEAD_DIM, make_batch

pytestmark = pytest.mark.skipif(load_decode_kernel() is None, reason="no C compiler")

SCALE = HEAD_DIM**-0.5
PROMPT = 70


def _run(batch, chunks: list[int], neighbour: bool, window: int | None = None,
         prompt: int = PROMPT) -> torch.Tensor:
    """Sequence 0's `prompt` queries fed in `chunks` (fresh pages each time); with `neighbour`,
    sequence 1 (40 cached tokens) decodes one token beside each chunk. Returns [prompt, Hq, D]."""
    block_size = batch.metadata.block_size
    tables = [batch.metadata.block_tables[s].tolist() for s in range(2)]
    backend, outs, start = PagedAttentionBackend(SCALE), [], 0
    for step, n in enumerate(chunks):
        seqs = [0, 1] if neighbour else [0]
        md = AttentionMetadata.build(
            block_tables=[tables[s] for s in seqs],
            num_computed_tokens=[start, 40 + step][: len(seqs)], query_lens=[n, 1][: len(seqs)],
            block_size=block_size, num_cache_blocks=batch.cache.num_blocks, sliding_window=window,
        )
        rows = list(range(start, start + n)) + ([prompt + step] if neighbour else [])
        k = torch.cat([batch.full_k[0][start:start + n]]
                      + ([batch.full_k[1][40 + step:41 + step]] if neighbour else []))
        v = torch.cat([batch.full_v[0][start:start + n]]
                      + ([batch.full_v[1][40 + step:41 + step]] if neighbour else []))
        outs.append(backend.forward(0, batch.q[rows].contiguous(), k, v, batch.cache, md)[:n])
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE], ids=str)
def test_a_query_is_the_same_bits_in_any_step(dtype) -> None:
    batch = make_batch(cached=[0, 40], new=[PROMPT, 6], group=3, block_size=8, dtype=dtype)
    whole = _run(batch, [PROMPT], neighbour=False)
    for chunks, neighbour in (([PROMPT], True), ([23, 1, 16, 9, 21], True),
                              ([1] * PROMPT, False), ([64, 6], False)):
        got = _run(batch, chunks, neighbour)
        assert torch.equal(got, whole), f"chunks {chunks}, neighbour {neighbour}"


def test_a_windowed_query_is_the_same_bits_in_any_step() -> None:
    """A sliding window (20 keys, pages of 8, so windows start mid-page): each row starts at its
    own first key whatever step computes it; the values are dense windowed attention's."""
    batch = make_batch(cached=[0, 40], new=[PROMPT, 6], group=3, block_size=8)
    whole = _run(batch, [PROMPT], neighbour=False, window=20)
    for chunks, neighbour in (([PROMPT], True), ([23, 1, 16, 9, 21], True), ([1] * PROMPT, False)):
        assert torch.equal(_run(batch, chunks, neighbour, window=20), whole), chunks
    k, v = batch.full_k[0].float(), batch.full_v[0].float()
    group = batch.q.shape[1] // k.shape[1]
    for p in (5, 19, 20, 37, 69):
        keys = slice(max(0, p - 19), p + 1)
        kk = k[keys].repeat_interleave(group, dim=1)  # [n, Hq, D]
        vv = v[keys].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", batch.q[p].float(), kk) * SCALE, -1)
        expected = torch.einsum("hn,nhd->hd", weights, vv)
        torch.testing.assert_close(whole[p].float(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE], ids=str)
@pytest.mark.parametrize("window", [None, 300])
def test_a_query_over_several_spans_is_the_same_bits_in_any_step(dtype, window) -> None:
    """Queries over more than a span's keys (paged_decode.c's SPAN, 256: spans attended on their
    own and folded in order) get the same bits as a decode step, where the spans are units of
    work of their own, and in prefill chunks of any size, where a row group folds them in turn;
    a 300-key window starts mid-page and mid-span. The values are dense attention's."""
    long = 700
    batch = make_batch(cached=[0, 40], new=[long, 6], group=3, block_size=8, dtype=dtype)
    whole = _run(batch, [long], neighbour=False, window=window, prompt=long)
    for chunks, neighbour in (([long], True), ([257, 1, 255, 187], True),
                              ([600] + [1] * 100, False), ([64] * 10 + [60], False)):
        got = _run(batch, chunks, neighbour, window=window, prompt=long)
        assert torch.equal(got, whole), f"chunks {chunks[:5]}, neighbour {neighbour}"
    k, v = batch.full_k[0].float(), batch.full_v[0].float()
    group = batch.q.shape[1] // k.shape[1]
    for p in (255, 256, 511, 512, 699):
        keys = slice(0 if window is None else max(0, p + 1 - window), p + 1)
        kk = k[keys].repeat_interleave(group, dim=1)
        vv = v[keys].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", batch.q[p].float(), kk) * SCALE, -1)
        expected = torch.einsum("hn,nhd->hd", weights, vv)
        tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}.get(dtype, 1e-1)  # fp8: 3 bits
        torch.testing.assert_close(whole[p].float(), expected, rtol=tolerance, atol=tolerance)


def test_the_split_over_threads_is_off() -> None:
    """A lone long sequence decoding: the flash-decoding split (parts merged by log-sum-exp) would
    serve it in the faster mode; the invariant one gives the bits of the same query in a batch."""
    batch = make_batch(cached=[600, 3, 9, 30], new=[1, 1, 1, 1], group=3, block_size=16)
    together = PagedAttentionBackend(SCALE).forward(
        0, batch.q, batch.new_k, batch.new_v, batch.cache, batch.metadata)
    alone_md = AttentionMetadata.build(
        block_tables=[batch.metadata.block_tables[0].tolist()], num_computed_tokens=[600],
        query_lens=[1], block_size=16, num_cache_blocks=batch.cache.num_blocks)
    alone = PagedAttentionBackend(SCALE).forward(
        0, batch.q[:1], batch.new_k[:1], batch.new_v[:1], batch.cache, alone_md)
    assert torch.equal(alone, together[:1])


@pytest.mark.parametrize("head_dim", [16, 64, 256])
@pytest.mark.parametrize("window", [None, 300])
def test_a_lone_sequence_split_by_query_heads_is_the_same_bits(monkeypatch, head_dim,
                                                                window) -> None:
    """One long sequence with one kv head decoding alone (Gemma 3's shape): the kernel deals
    its four query heads to the threads (each reads the same keys); in a batch of four it does
    not. A head's output is the same bits either way, and dense attention's values."""
    from tests.attention import paged_testing

    monkeypatch.setattr(paged_testing, "HEAD_DIM", head_dim)
    batch = make_batch(cached=[600, 3, 9, 30], new=[1, 1, 1, 1], group=4, block_size=16,
                       num_kv_heads=1)
    scale = head_dim**-0.5
    tables = [batch.metadata.block_tables[s].tolist() for s in range(4)]
    together_md = AttentionMetadata.build(
        block_tables=tables, num_computed_tokens=[600, 3, 9, 30], query_lens=[1] * 4,
        block_size=16, num_cache_blocks=batch.cache.num_blocks, sliding_window=window)
    together = PagedAttentionBackend(scale).forward(
        0, batch.q, batch.new_k, batch.new_v, batch.cache, together_md)
    alone_md = AttentionMetadata.build(
        block_tables=tables[:1], num_computed_tokens=[600], query_lens=[1], block_size=16,
        num_cache_blocks=batch.cache.num_blocks, sliding_window=window)
    alone = PagedAttentionBackend(scale).forward(
        0, batch.q[:1], batch.new_k[:1], batch.new_v[:1], batch.cache, alone_md)
    assert torch.equal(alone, together[:1])
    keys = slice(0 if window is None else 601 - window, 601)
    k, v = batch.full_k[0][keys].float(), batch.full_v[0][keys].float()  # [n, 1, D]
    weights = torch.softmax(torch.einsum("hd,nd->hn", batch.q[0].float(), k[:, 0]) * scale, -1)
    torch.testing.assert_close(alone[0].float(), weights @ v[:, 0], rtol=1e-5, atol=1e-5)
