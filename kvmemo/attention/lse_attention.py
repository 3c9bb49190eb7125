"""Attention that also returns its log-sum-exp, the merge of two partial attention states over
disjoint keys, and GQA query folding: the primitives cascade (cascade.py), the paged backend's
prefill (paged.py) and chunk blending (blend.py) build on.
"""

from __future__ import annotations

import torch

from kvmemo.attention.kernels.flash_attention import flash_attention


def merge_attention_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Softmax-merge two partial attentions over disjoint keys. o: [T, H, D], lse: [T, H]. fp32 out.

    w_a / (w_a + w_b) with w = exp(lse - max) is exactly sigmoid(lse_a - lse_b).
    """
    weight_a = torch.sigmoid(lse_a.float() - lse_b.float()).unsqueeze(-1)  # [T, H, 1]
    o_b = o_b.float()
    return o_b + (o_a.float() - o_b) * weight_a


def fold_query_groups(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[Lq, Hq, D] -> [1, Hkv, G * Lq, D]: row g * Lq + i is query i of head h * G + g, so each
    kv head's keys are read once for its G query heads."""
    query_len, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    qg = q.view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    return qg.reshape(1, num_kv_heads, group * query_len, head_dim)


def unfold_query_groups(o: torch.Tensor, query_len: int) -> torch.Tensor:
    """fold_query_groups' inverse: [1, Hkv, G * Lq, D] -> [Lq, Hq, D]."""
    _, num_kv_heads, rows, head_dim = o.shape
    group = rows // query_len
    o = o.view(num_kv_heads, group, query_len, head_dim).permute(2, 0, 1, 3)
    return o.reshape(query_len, num_kv_heads * group, head_dim)


def attention_with_lse_upto(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, H, Lk, D]
    v: torch.Tensor,
    last_key: torch.Tensor | None,  # int [B, Lq] or [Lq]: row i sees keys [0, last_key[i]]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse for masks that end each row at a key (causal, padded lengths):
    o [B, H, Lq, D] (fp32 from the compiled kernel, else q's dtype) and fp32 lse [B, H, Lq].

    CPU: kvmemo's flash kernel (kernels/flash_attention.py, 2-4x torch's here) when it can run the
    call.
    """
    if q.device.type == "cpu":
        result = flash_attention(q, k, v, last_key, scale)
        if result is not None:
            return result
    valid = None
    if last_key is not None:
        rows = last_key.reshape(-1, q.shape[2]).to(q.device)  # [B or 1, Lq]
        keys = torch.arange(k.shape[2], device=q.device)
        valid = (keys[None, None, :] <= rows[:, :, None])[:, None]  # [B or 1, 1, Lq, Lk]
    return attention_with_lse(q, k, v, valid, scale)


def attention_with_lse(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, H, Lk, D]
    v: torch.Tensor,
    valid: torch.Tensor | None,  # bool, broadcastable to [B, H, Lq, Lk]; every row has a True
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning o [B, H, Lq, D] and the fp32 log-sum-exp of scores [B, H, Lq].

    CPU uses the fused flash kernel (tiled, ~5x faster than matmul + logsumexp, measured);
    other devices use the explicit math.
    """
    if q.device.type == "cpu":
        bias = None
        if valid is not None:  # the CPU flash kernel takes an additive mask of q's dtype
            bias = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~valid, float("-inf")
            )
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=bias, scale=scale
        )
    return attention_with_lse_math(q, k, v, valid, scale)


def attention_with_lse_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The explicit form of attention_with_lse, in fp32. Materialises scores [B, H, Lq, Lk]."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Lq]
    o = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return o.to(q.dtype), lse
