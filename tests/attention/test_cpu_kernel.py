"""The compiled CPU decode kernel against dense attention over the same pages, called directly."""

from __future__ import annotations

import pytest
import torch

from kvmemo.attention.cache import FP8_DTYPE
from kvmemo.attention.kernels.paged_decode import load_decode_kernel
from kvmemo.paths import cache_root

DTYPES = [torch.float32, torch.bfloat16, torch.float16, FP8_DTYPE]


def dense_decode(q, k_pages, v_pages, tables, rows, first_block, lens, scale):
    """Per query: gather its keys block by block, repeat K/V per group, softmax. -> out, lse."""
    num_kv_heads, _, block_size, head_dim = k_pages.shape
    group = q.shape[1] // num_kv_heads
    outs, lses = [], []
    for b in range(q.shape[0]):
        row = tables[b if rows is None else int(rows[b])]
        length = int(lens[b])
        ids = row[first_block : first_block + -(-length // block_size)]
        k = k_pages[:, ids].reshape(num_kv_heads, -1, head_dim)[:, :length].float()
        v = v_pages[:, ids].reshape(num_kv_heads, -1, head_dim)[:, :length].float()
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, L, D]
        scores = torch.einsum("hd,hld->hl", q[b].float(), k) * scale
        outs.append(torch.einsum("hl,hld->hd", scores.softmax(-1), v))
        lses.append(torch.logsumexp(scores, -1))
    return torch.stack(outs), torch.stack(lses)


@pytest.fixture(scope="module")
def kernel():
    loaded = load_decode_kernel()
    if loaded is None:
        pytest.skip("no C compiler here: the CPU decode kernel cannot be built")
    return loaded


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])  # 64 and 128 take the vector path
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_kernel_matches_dense(kernel, dtype, head_dim, group, block_size):
    torch.manual_seed(head_dim * 100 + group * 10 + block_size)
    num_kv_heads, num_blocks, batch, width = 2, 40, 5, 8
    k_pages = (torch.randn(num_kv_heads, num_blocks, block_size, head_dim) * 3).to(dtype)
    v_pages = torch.randn(num_kv_heads, num_blocks, block_size, head_dim).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in range(7)])  # 7 rows, 5 used
    rows = torch.tensor([6, 0, 3, 3, 1])
    first_block = 2  # a cascade suffix: keys start after two shared blocks
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, (width - first_block) * block_size])
    q = torch.randn(batch, num_kv_heads * group, head_dim)
    scale = head_dim**-0.5
    out, lse = kernel(q, k_pages, v_pages, tables, rows, first_block, lens, scale, with_lse=True)
    want_out, want_lse = dense_decode(q, k_pages, v_pages, tables, rows, first_block, lens, scale)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_kernel_decodes_every_fp8_code_exactly(kernel):
    """One key per sequence: its softmax weight is exactly 1, so the output is the decoded V row.
    V holds all 254 finite e4m3 codes (subnormals and both zeros included): each must come out
    bit-equal to torch's own fp8 -> fp32 conversion."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0  # the two NaN codes are never stored
    head_dim, batch = 64, 4
    v_pages = codes.view(FP8_DTYPE).reshape(1, batch, 1, head_dim)  # [Hkv, blocks, bs=1, D]
    k_pages = torch.zeros_like(v_pages)
    tables = torch.arange(batch)[:, None]  # sequence b reads block b
    q = torch.randn(batch, 1, head_dim)
    out, _ = kernel(q, k_pages, v_pages, tables, None, 0, torch.ones(batch, dtype=torch.int64), 1.0)
    want = v_pages.float().reshape(batch, 1, head_dim)
    assert torch.equal(out, want)
    assert (want[want != 0].abs() < 2.0**-6).sum() == 14  # subnormals really were covered


def test_kernel_softmax_is_stable_for_large_scores(kernel):
    """Scores in the thousands (exp would overflow) and far apart (exp would underflow)."""
    torch.manual_seed(0)
    k_pages = torch.randn(1, 8, 16, 64) * 40
    v_pages = torch.randn(1, 8, 16, 64)
    tables = torch.arange(8)[None].repeat(2, 1)
    q = torch.randn(2, 1, 64) * 40
    lens = torch.tensor([100, 128])
    out, lse = kernel(q, k_pages, v_pages, tables, None, 0, lens, 1.0, with_lse=True)
    want_out, want_lse = dense_decode(q, k_pages, v_pages, tables, None, 0, lens, 1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-5)


def test_loading_the_kernel_keeps_subnormal_floats(kernel):
    """The library must not set flush-to-zero for the process (what -ffast-math linking does)."""
    smallest_normal = float(torch.finfo(torch.float64).tiny)
    assert smallest_normal / 2 != 0.0  # Python floats: a subnormal survives
    tiny = torch.tensor(torch.finfo(torch.float32).tiny)
    assert float(tiny / 2) != 0.0  # and torch's CPU kernels keep float32 subnormals too


def test_kernel_refuses_shapes_it_cannot_hold(kernel):
    q = torch.randn(1, 64, 16)
    pages = torch.zeros(1, 2, 8, 16)
    assert not kernel.supports(q, pages, pages)  # 64 query heads per kv head > MAX_GROUP
    with pytest.raises(ValueError, match="group <= 32"):
        kernel(q, pages, pages, torch.zeros(1, 2, dtype=torch.int64), None, 0, torch.tensor([4]), 1.0)
    assert not kernel.supports(torch.randn(1, 2, 16), pages.transpose(1, 2), pages)  # not contiguous


def test_the_kernel_is_built_into_the_cache_directory():
    """Where the decode kernel's build lives (the cache's reuse and repair are tested on a small
    source in tests/model/test_native_builder.py: the same load_library, without building this
    kernel twice more)."""
    load_decode_kernel.cache_clear()
    try:
        kernel = load_decode_kernel()
        if kernel is None:
            pytest.skip("no C compiler here")
        assert kernel.path.parent == cache_root() / "kernels"
        assert kernel.path.name.startswith("paged_decode-")
    finally:
        load_decode_kernel.cache_clear()


def test_no_compiler_or_disabled_means_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMEMO_CACHE_DIR", str(tmp_path))
    load_decode_kernel.cache_clear()
    try:
        monkeypatch.setenv("KVMEMO_CPU_KERNEL", "0")
        assert load_decode_kernel() is None
        load_decode_kernel.cache_clear()
        monkeypatch.delenv("KVMEMO_CPU_KERNEL")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        assert load_decode_kernel() is None  # logged, not raised
        assert not list(tmp_path.glob("kernels/*.so"))
    finally:
        load_decode_kernel.cache_clear()


@pytest.mark.parametrize("io_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [48, 64, 128])  # 64 and 128 take the vector path
def test_write_and_decode_from_a_prefix_state(kernel, io_dtype, head_dim):
    """write_and_decode with a cascade prefix's attention as its starting state, q/k/v strided
    views of one qkv row as the model hands them over: the new K/V land in their slots, and the
    output is attention over the prefix's keys and the sequence's own, new key included."""
    torch.manual_seed(head_dim)
    num_kv_heads, group, block_size, num_blocks, batch = 2, 3, 16, 30, 4
    num_heads = num_kv_heads * group
    k_pages = torch.randn(num_kv_heads, num_blocks, block_size, head_dim).to(io_dtype)
    v_pages = torch.randn(num_kv_heads, num_blocks, block_size, head_dim).to(io_dtype)
    prefix_blocks, prefix_len = 2, 2 * block_size
    prefix_k = k_pages[:, :prefix_blocks].reshape(num_kv_heads, prefix_len, head_dim)
    prefix_v = v_pages[:, :prefix_blocks].reshape(num_kv_heads, prefix_len, head_dim)
    own = torch.arange(prefix_blocks, num_blocks)[torch.randperm(num_blocks - prefix_blocks)]
    tables = torch.stack([torch.cat([torch.arange(prefix_blocks), own[3 * b : 3 * b + 3]])
                          for b in range(batch)])  # [B, 5]: shared prefix, then 3 own blocks
    lens = torch.tensor([1, 7, block_size + 1, 3 * block_size])  # own keys, the new one too
    slots = torch.stack([tables[b, prefix_blocks + (n - 1) // block_size] * block_size
                         + (n - 1) % block_size for b, n in enumerate(lens.tolist())])
    qkv = torch.randn(batch, (num_heads + 2 * num_kv_heads) * head_dim).to(io_dtype)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(batch, num_heads, head_dim)
    k = qkv[:, q_end:k_end].view(batch, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(batch, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    # the prefix's attention (what cascade_prefix_state hands over), by torch
    pk = prefix_k.float().repeat_interleave(group, 0)  # [Hq, Lp, D]
    pv = prefix_v.float().repeat_interleave(group, 0)
    prefix_scores = torch.einsum("bhd,hld->bhl", q.float(), pk) * scale
    o_prefix = torch.einsum("bhl,hld->bhd", prefix_scores.softmax(-1), pv).contiguous()
    lse_prefix = torch.logsumexp(prefix_scores, -1).contiguous()
    out = kernel.write_and_decode(q, k, v, slots, k_pages, v_pages, tables, None, lens, scale,
                                  first_block=prefix_blocks, prefix=(o_prefix, lse_prefix))
    flat_k, flat_v = k_pages.flatten(1, 2), v_pages.flatten(1, 2)  # [Hkv, slots, D]
    assert torch.equal(flat_k[:, slots].transpose(0, 1), k)
    assert torch.equal(flat_v[:, slots].transpose(0, 1), v)
    expected = []
    for b in range(batch):
        ids = tables[b, prefix_blocks : prefix_blocks + -(-int(lens[b]) // block_size)]
        own_k = k_pages[:, ids].reshape(num_kv_heads, -1, head_dim)[:, : int(lens[b])]
        own_v = v_pages[:, ids].reshape(num_kv_heads, -1, head_dim)[:, : int(lens[b])]
        keys = torch.cat([prefix_k, own_k], 1).float().repeat_interleave(group, 0)
        values = torch.cat([prefix_v, own_v], 1).float().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hld->hl", q[b].float(), keys) * scale
        expected.append(torch.einsum("hl,hld->hd", scores.softmax(-1), values))
    assert out.dtype == io_dtype
    tolerance = 2e-5 if io_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), torch.stack(expected), atol=tolerance, rtol=tolerance)


@pytest.fixture
def four_threads():
    """OpenMP's thread count for the kernel's split decision: 4, whatever this machine has."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("io_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_prefix", [False, True], ids=["alone", "prefix-state"])
@pytest.mark.parametrize("length", [700, 1 + 16 * 37])  # parts of unequal pages; a 1-key page
# (kv heads, group, D): SmolLM2's; 4 heads a pass at D 64 and 2 a pass at D 128 (AVX-512)
@pytest.mark.parametrize("heads", [(3, 3, 64), (1, 8, 64), (2, 4, 128)], ids=str)
def test_one_long_sequence_is_split_over_threads_and_merged(kernel, four_threads, io_dtype,
                                                            with_prefix, length, heads):
    """One sequence decoding alone has fewer (sequence, kv head) items than threads, so the
    kernel cuts its keys into parts of whole pages and merges them by log-sum-exp: the result
    must equal attention over all of them (and the new key, written first, must be seen)."""
    torch.manual_seed(length)
    (num_kv_heads, group, head_dim), block_size = heads, 16
    num_heads, blocks = num_kv_heads * group, -(-length // block_size)
    num_blocks = blocks + 5
    k_pages = (torch.randn(num_kv_heads, num_blocks, block_size, head_dim) * 2).to(io_dtype)
    v_pages = torch.randn(num_kv_heads, num_blocks, block_size, head_dim).to(io_dtype)
    tables = torch.randperm(num_blocks)[:blocks][None]  # scattered pages
    lens = torch.tensor([length])
    slots = tables[0, (length - 1) // block_size] * block_size + (length - 1) % block_size
    q = torch.randn(1, num_heads, head_dim).to(io_dtype)
    k = torch.randn(1, num_kv_heads, head_dim).to(io_dtype)
    v = torch.randn(1, num_kv_heads, head_dim).to(io_dtype)
    scale = head_dim**-0.5
    prefix = None
    if with_prefix:  # a starting state over 40 other keys, by torch
        pk, pv = torch.randn(num_heads, 40, head_dim), torch.randn(num_heads, 40, head_dim)
        prefix_scores = torch.einsum("hd,hld->hl", q[0].float(), pk) * scale
        prefix = (torch.einsum("hl,hld->hd", prefix_scores.softmax(-1), pv)[None].contiguous(),
                  torch.logsumexp(prefix_scores, -1)[None].contiguous())
    out = kernel.write_and_decode(q, k, v, slots[None], k_pages, v_pages, tables, None, lens,
                                  scale, prefix=prefix)
    own_k = k_pages[:, tables[0]].reshape(num_kv_heads, -1, head_dim)[:, :length]
    own_v = v_pages[:, tables[0]].reshape(num_kv_heads, -1, head_dim)[:, :length]
    assert torch.equal(own_k[:, -1], k[0]) and torch.equal(own_v[:, -1], v[0])
    own_k = own_k.float().repeat_interleave(group, 0)  # [Hq, L, D]
    own_v = own_v.float().repeat_interleave(group, 0)
    keys, values = own_k, own_v
    if with_prefix:
        keys, values = torch.cat([pk, own_k], 1), torch.cat([pv, own_v], 1)
    scores = torch.einsum("hd,hld->hl", q[0].float(), keys) * scale
    expected = torch.einsum("hl,hld->hd", scores.softmax(-1), values)
    tolerance = 2e-5 if io_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[0].float(), expected, atol=tolerance, rtol=tolerance)
    # __call__ (no write, no starting state) gives the log-sum-exp from the same split path
    own_scores = torch.einsum("hd,hld->hl", q[0].float(), own_k) * scale
    o_own, lse_own = kernel(q, k_pages, v_pages, tables, None, 0, lens, scale, with_lse=True)
    torch.testing.assert_close(o_own[0].float(),
                               torch.einsum("hl,hld->hd", own_scores.softmax(-1), own_v),
                               atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse_own[0], torch.logsumexp(own_scores, -1), atol=1e-4, rtol=1e-4)


def test_an_empty_batch_returns_empty_outputs(kernel, four_threads):
    """No sequences: nothing to attend, nothing to split (the split's part count divides by the
    number of items)."""
    k_pages = torch.randn(3, 4, 16, 64)
    q = torch.randn(0, 9, 64)
    tables = torch.zeros(0, 2, dtype=torch.int64)
    out, lse = kernel(q, k_pages, k_pages, tables, None, 0, torch.zeros(0, dtype=torch.int64),
                      0.125, with_lse=True)
    assert out.shape == (0, 9, 64) and lse is not None and lse.shape == (0, 9)
