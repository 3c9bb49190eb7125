"""fp8 attention without dequantising pages: fold the transform into the query, unfold it from
the output. Every backend that reads raw fp8 pages (paged, triton) calls these two."""

from __future__ import annotations

import torch

from kvmemo.attention.cache import PagedKVCache


def fold_fp8_query(q: torch.Tensor, kv_cache: PagedKVCache, layer: int) -> torch.Tensor:
    """For fp8, the query that attends over the raw stored K: (q @ rotation) * k_scale.

    Exact, so attention reads the raw fp8 values and never dequantises the cache. With
    k = k8 * s @ R.T + mu (R orthogonal): q . k = ((q @ R) * s) . k8 + q . mu, and q . mu is the
    same for every key of the query, which softmax ignores (cascade's two partial lse shift
    equally, so their merge is unchanged too). q: [T, Hq, D].
    """
    if not kv_cache.is_fp8:
        return q
    t = kv_cache.fp8_transform(layer, "k")
    group = q.shape[1] // kv_cache.num_kv_heads
    k_scale = t.scale.repeat_interleave(group)  # [Hq]
    rotated = q if t.rotation is None else (q.float() @ t.rotation)
    return (rotated.float() * k_scale[None, :, None]).to(q.dtype)


def unfold_fp8_output(out: torch.Tensor, kv_cache: PagedKVCache, layer: int) -> torch.Tensor:
    """For fp8, real output from attention over the raw stored V: (out * v_scale) @ R.T + mu_v.

    Exact because the probabilities of each query sum to 1: sum_j p_j (v8_j * s @ R.T + mu)
    = (s * sum_j p_j v8_j) @ R.T + mu. out: [T, Hq, D].
    """
    if not kv_cache.is_fp8:
        return out
    t = kv_cache.fp8_transform(layer, "v")
    group = out.shape[1] // kv_cache.num_kv_heads
    v_scale = t.scale.repeat_interleave(group)[None, :, None]  # [1, Hq, 1]
    v_offset = t.offset.repeat_interleave(group, dim=0)  # [Hq, D]
    real = out.float() * v_scale
    if t.rotation is not None:
        real = real @ t.rotation.T
    return (real + v_offset).to(out.dtype)
