"""Sampler: the next token of every sampling sequence in a step, from its logits row.

Invariant: a request with a seed draws from its own generator, seeded from (seed, step), so its
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmemo.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # log p(token) under the model's distribution, when logprobs asked
    top_logprobs: dict[int, float] | None  # top-k alternatives, when logprobs > 0


class Sampler:
    """Owns the default generator used by unseeded requests."""

    def __init__(self, seed: int, device: torch.device | str):
        self.device = torch.device(device)
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], num_output_tokens: list[int]
    ) -> list[SampledToken]:
        """logits: [N, vocab] fp32, one row per sampling sequence."""
        token_ids = torch.argmax(logits, dim=-1)  # [N]; greedy rows are done
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = self._filtered_probs(logits[rows], [params[i] for i in random_rows])
            for j, i in enumerate(random_rows):
                generator = self._generator_for(params[i], num_output_tokens[i])
                token_ids[i] = torch.multinomial(probs[j], 1, generator=generator)[0]
        return self._with_logprobs(logits, token_ids, params)

    def _generator_for(self, params: SamplingParams, step: int) -> torch.Generator:
        if params.seed is None:
            return self.default_generator
        # A fresh generator per (seed, step): reproducible in any batch, even after preemption.
        generator = torch.Generator(device=self.device)
        generator.manual_seed((params.seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
        return generator

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, then top-k, top-p and min-p cuts; returns probabilities [n, vocab]."""
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperature[:, None]
        if any(p.top_k > 0 for p in params):
            vocab = logits.shape[-1]
            # top_k beyond the vocabulary means no cut (and would overflow an int64 tensor).
            k = torch.tensor(
                [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device
            )
            ranked = torch.sort(logits, dim=-1, descending=True).values
            kth = ranked.gather(1, (k - 1).clamp(max=vocab - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            # Keep the smallest set whose mass reaches top_p (always the first token).
            drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=logits.device)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
    ) -> list[SampledToken]:
        ids = token_ids.tolist()
        if all(p.logprobs is None for p in params):
            return [SampledToken(t, None, None) for t in ids]
        logprobs = torch.log_softmax(logits, dim=-1)
        out: list[SampledToken] = []
        for i, (t, p) in enumerate(zip(ids, params)):
            if p.logprobs is None:
                out.append(SampledToken(t, None, None))
                continue
            top: dict[int, float] | None = None
            if p.logprobs > 0:
                values, indices = torch.topk(logprobs[i], p.logprobs)
                top = dict(zip(indices.tolist(), values.tolist()))
            out.append(SampledToken(t, float(logprobs[i, t]), top))
        return out
