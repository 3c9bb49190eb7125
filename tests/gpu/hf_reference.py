"""HF transformers' greedy tokens the way the engine's greedy runs with ignore_eos: plain argmax
at every step, past EOS too (generate() with min_new_tokens would mask EOS instead, which once
made an H100 run disagree at the position where the model chose EOS)."""

from __future__ import annotations

import torch


def hf_greedy(hf: torch.nn.Module, ids: list[int], num_new: int) -> list[int]:
    device = next(hf.parameters()).device
    tokens: list[int] = []
    with torch.inference_mode():
        out = hf(torch.tensor([ids], device=device), use_cache=True)
        for _ in range(num_new):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]], device=device),
                     past_key_values=out.past_key_values, use_cache=True)
    return tokens


def hf_teacher_forced(hf: torch.nn.Module, ids: list[int], continuation: list[int]) -> list[int]:
    """HF's argmax after each prefix of ids + continuation (one forward)."""
    device = next(hf.parameters()).device
    with torch.inference_mode():
        logits = hf(torch.tensor([ids + continuation[:-1]], device=device)).logits[0]
    return logits[len(ids) - 1:].argmax(-1).tolist()
