"""kvmemo's CPU flash kernel (kernels/flash_attention.c) against the explicit softmax attention:
shapes with row and key tails, one and several key tiles and softmax chunks, head sizes 64-256, grouped rows,
per-row last keys (causal, padded lengths), fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from kvmemo.attention.kernels.flash_attention import flash_attention
from kvmemo.attention.lse_attention import attention_with_lse_math, attention_with_lse_upto

SHAPES = [  # B, H, M rows, L keys, D
    (1, 3, 96, 1024, 64),  # a decode batch against a shared 1,024-token prefix
    (1, 2, 19, 1300, 64),  # softmax chunks of 512 keys: two whole, one of 276 (a key tail);
    # packing tasks of 256 keys: five whole, the last holding the padded tile
    (2, 3, 37, 200, 64),  # row tail (37 = 6 * 6 + 1), key tail (200 = 3 * 64 + 8)
    (1, 2, 5, 3, 128),  # fewer rows than a block, fewer keys than a tile
    (1, 1, 13, 70, 256),  # Gemma's head size
    (3, 1, 1, 1, 64),  # one row, one key
]


def _kernel_runs(dtype: torch.dtype) -> bool:
    q = torch.zeros(1, 1, 1, 64, dtype=dtype)
    return flash_attention(q, q, q, None, 1.0) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_kernel_equals_explicit_attention(dtype, shape, masked):
    if not _kernel_runs(dtype):
        pytest.skip(f"the flash kernel does not run {dtype} on this CPU (needs AVX-512 / BF16)")
    batch, heads, rows, keys, head_dim = shape
    gen = torch.Generator().manual_seed(hash((shape, masked)) % 2**31)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen).to(dtype)
               for n in (rows, keys, keys))
    last_key = torch.randint(0, keys, (batch, rows), generator=gen) if masked else None
    o, lse = flash_attention(q, k, v, last_key, 0.125)
    valid = None
    if masked:
        valid = (torch.arange(keys)[None, None, :] <= last_key[:, :, None])[:, None]
    o_ref, lse_ref = attention_with_lse_math(q.float(), k.float(), v.float(), valid, 0.125)
    assert o.dtype == torch.float32 and o.shape == (batch, heads, rows, head_dim)
    # bf16: the probabilities are rounded to bf16 before the PV product (8 bits of mantissa)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(o, o_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)


def test_strided_inputs_and_a_shared_row_mask():
    """Views with head and row strides (cascade reads the prefix in place), one [M] mask for all."""
    if not _kernel_runs(torch.float32):
        pytest.skip("the flash kernel does not run on this CPU (needs AVX-512)")
    gen = torch.Generator().manual_seed(0)
    pages = torch.randn(3, 40, 16, 64, generator=gen)  # [Hkv, blocks, block_size, D]
    k = pages[:, 4:12].flatten(1, 2)[None]  # [1, 3, 128, 64], strided across heads
    v = pages[:, 20:28].flatten(1, 2)[None]
    q = torch.randn(1, 3, 50, 64, generator=gen)
    last_key = torch.arange(78, 128)  # causal: row i sees keys up to 78 + i
    o, lse = flash_attention(q, k, v, last_key, 0.3)
    valid = (torch.arange(128)[None, :] <= last_key[:, None])[None, None]
    o_ref, lse_ref = attention_with_lse_math(q, k.contiguous(), v.contiguous(), valid, 0.3)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)


def test_calls_it_cannot_run_fall_back_to_torch(monkeypatch):
    """A head size that is not a multiple of 64 (or a disabled kernel) goes to torch's kernel,
    with the same values."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 48, generator=gen) for n in (7, 30, 30))
    assert flash_attention(q, k, v, None, 0.2) is None
    last_key = torch.arange(23, 30)
    o, lse = attention_with_lse_upto(q, k, v, last_key, 0.2)
    valid = (torch.arange(30)[None, :] <= last_key[:, None])[None, None]
    o_ref, lse_ref = attention_with_lse_math(q, k, v, valid, 0.2)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)


def test_limits_outside_the_keys_are_clamped_to_them():
    """A last key below 0 reads as key 0 (never a row with nothing to attend to, which would be
    NaN); one beyond the keys as the last key."""
    if not _kernel_runs(torch.float32):
        pytest.skip("the flash kernel does not run on this CPU (needs AVX-512)")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, n, 64, generator=gen) for n in (3, 10, 10))
    o, lse = flash_attention(q, k, v, torch.tensor([-3, 99, 4]), 0.5)
    o_ref, lse_ref = flash_attention(q, k, v, torch.tensor([0, 9, 4]), 0.5)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o_ref, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=0, rtol=0)
