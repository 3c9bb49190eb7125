"""Sampler: the next token of every sampling sequence in a step, from its logits row.

Invariant: a request with a seed draws from its own generator, seeded from (seed, step), so its
tokens do not depend on what else is in the batch; grammar masks, penalties and biases change
only their own row's logits (logprobs report the model's own distribution, as vLLM's default
does), and a constrained row never samples a token its grammar forbids.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from kvmemo.engine.kernels.sampling import can_sample_rows, sample_rows
from kvmemo.sampling import SamplingParams
from kvmemo.structured.grammar import Constraint, FixedMask, allowed_token_masks


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # log p(token) under the model's distribution, when logprobs asked
    top_logprobs: dict[int, float] | None  # top-k alternatives, when logprobs > 0


logger = logging.getLogger(__name__)

_MAX_LOGIT = 1e30

# (prompt token ids, output token ids so far) of one sequence: what its penalties count.
TokenHistory = tuple[Sequence[int], Sequence[int]]


class Sampler:
    """Owns the default generator used by unseeded requests."""

    def __init__(
        self, seed: int, device: torch.device | str, eos_token_ids: Collection[int] = ()
    ):
        self.device = torch.device(device)
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(seed)
        self.eos_token_ids = tuple(eos_token_ids)  # min_tokens holds these back

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        num_output_tokens: list[int],
        histories: Sequence[TokenHistory | None] | None = None,
        constraints: Sequence[Constraint | FixedMask | None] | None = None,
    ) -> list[SampledToken]:
        """logits: [N, vocab] fp32, one row per sampling sequence. histories[i] is needed for a
        row whose params have penalties (SamplingParams.has_penalties); constraints[i] is the
        row's structured-output grammar, if any."""
        raw = logits
        if constraints is not None and any(c is not None for c in constraints):
            # First, so the penalties' fallback for a row they empty keeps the grammar. The
            # model's own logits are kept only if logprobs are asked for (they report them).
            keep_raw = any(p.logprobs is not None for p in params)
            logits = _masked_by_grammar(logits, constraints, in_place=not keep_raw)
        if any(p.has_penalties for p in params):
            logits = self._penalized(logits, params, histories or [None] * len(params))
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(random_rows) < len(params):
            token_ids = argmax_rows(logits)  # [N]; greedy rows are done
        else:  # every row samples: an argmax pass over the vocabulary would be thrown away
            token_ids = torch.zeros(len(params), dtype=torch.int64, device=logits.device)
        if random_rows:
            self._sample_random(logits, params, num_output_tokens, random_rows, token_ids)
        return self._with_logprobs(raw, token_ids, params)

    def _penalized(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        histories: Sequence[TokenHistory | None],
    ) -> torch.Tensor:
        """A copy of logits with each row's penalties, biases, bans and minimum length applied,
        in vLLM's order: repetition, frequency and presence, logit_bias, allowed_token_ids, bad
        words, min_tokens.
        Counting happens only for the rows that asked."""
        raw_logits = logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        device = logits.device
        for i, p in enumerate(params):
            if not p.has_penalties:
                continue
            history = histories[i]
            if history is None:
                raise ValueError("a request with penalties needs its token history")
            prompt_ids, output_ids = history
            row = logits[i]
            output = torch.as_tensor(list(output_ids), dtype=torch.int64, device=device)
            counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)  # [vocab]
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                prompt = torch.as_tensor(list(prompt_ids), dtype=torch.int64, device=device)
                seen[prompt[prompt < vocab]] = True
                penalized = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                row.copy_(torch.where(seen, penalized, row))
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                present = (counts > 0).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * present
            if p.logit_bias:
                ids = [t for t in p.logit_bias if t < vocab]
                index = torch.tensor(ids, dtype=torch.int64, device=device)
                bias = torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype, device=device)
                row.index_add_(0, index, bias)
            if p.allowed_token_ids is not None:
                keep = torch.zeros(vocab, dtype=torch.bool, device=device)
                keep[torch.tensor([t for t in p.allowed_token_ids if t < vocab],
                                  dtype=torch.int64, device=device)] = True
                row.masked_fill_(~keep, float("-inf"))
            for banned in p.bad_words_token_ids:
                # Ban the word's last token where the output already ends with the rest of it.
                head = banned[:-1]
                if banned[-1] < vocab and (
                    not head or tuple(output_ids[len(output_ids) - len(head):]) == head
                ):
                    row[banned[-1]] = float("-inf")
            if len(output_ids) < p.min_tokens:
                stops = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < vocab]
                if stops:
                    row[torch.tensor(stops, dtype=torch.int64, device=device)] = float("-inf")
        # Extreme (valid) penalties can overflow: logits are capped at 1e30 (which still
        # survives division by the smallest sampling temperature, 1e-5), NaN becomes -inf, and
        # a row left with no finite logit keeps the model's own, so a request cannot break the
        # step that samples its neighbours too.
        torch.nan_to_num_(logits, nan=float("-inf"), posinf=_MAX_LOGIT, neginf=float("-inf"))
        logits.clamp_(max=_MAX_LOGIT)
        dead = ~torch.isfinite(logits).any(dim=-1)
        if bool(dead.any()):
            logits[dead] = raw_logits[dead]
        return logits

    def _sample_random(
        self, logits: torch.Tensor, params: list[SamplingParams], num_output_tokens: list[int],
        rows: list[int], token_ids: torch.Tensor,
    ) -> None:
        """Draws the token of each row in `rows` into token_ids by inverse CDF: one uniform per
        usable row from the row's own generator, in row order. A row sampled at its temperature
        alone (no top-k/top-p/min-p) goes through the C kernel (kernels/sampling.py) whatever
        its neighbours ask, so a seeded request's tokens do not depend on its batch; the others
        through torch's softmax, cumsum and search (torch.multinomial drew a random per
        vocabulary entry: 48 ms for 64 rows of 49,152). A row with no usable probability mass
        (an overflow no check foresaw) keeps its argmax and draws nothing: one request must
        never fail the step its whole batch shares."""
        device = logits.device
        fused = can_sample_rows(logits)
        plain = [i for i in rows if fused and _temperature_only(params[i], logits.shape[-1])]
        plain_set = set(plain)
        cut = [i for i in rows if i not in plain_set]
        usable: dict[int, bool] = {}
        plain_logits = _rows_of(logits, plain)
        if plain:
            inverse = 1.0 / torch.tensor([params[i].temperature for i in plain],
                                         dtype=torch.float32, device=device)
            # the kernel's max of logits * (1 / temperature), both in fp32: finite (no NaN, no
            # overflow) or the row is unusable
            top = plain_logits.amax(dim=-1) * inverse
            usable.update(zip(plain, torch.isfinite(top).tolist()))
        probs = None
        if cut:
            probs = self._filtered_probs(_rows_of(logits, cut), [params[i] for i in cut])
            sums = probs.sum(dim=-1)  # NaN or inf anywhere in a row makes its sum so too
            usable.update(zip(cut, (torch.isfinite(sums) & (sums > 0)).tolist()))
        draws = {
            i: float(torch.rand(1, generator=self._generator_for(params[i], num_output_tokens[i]),
                                device=self.device))
            for i in rows if usable[i]
        }
        for i in rows:
            if not usable[i]:
                logger.warning("sampling row %d has no usable probabilities: greedy", i)
                token_ids[i] = torch.nan_to_num(logits[i], nan=float("-inf")).argmax()
        live_plain = [j for j, i in enumerate(plain) if usable[i]]
        if live_plain:
            source = _rows_of(plain_logits, live_plain)
            temps = [params[plain[j]].temperature for j in live_plain]
            uniforms = [draws[plain[j]] for j in live_plain]
            tokens = sample_rows(source.contiguous(), temps, uniforms)
            if tokens is None:  # the kernel could not run after all: the same draws via torch
                scaled = source / torch.tensor(temps, device=device)[:, None]
                tokens = _inverse_cdf(torch.softmax(scaled, dim=-1),
                                      torch.tensor(uniforms, device=device)).tolist()
            for j, token in zip(live_plain, tokens):
                token_ids[plain[j]] = token
        live_cut = [j for j, i in enumerate(cut) if usable[i]]
        if live_cut and probs is not None:
            uniforms_cut = torch.tensor([draws[cut[j]] for j in live_cut], dtype=probs.dtype,
                                        device=device)
            live_probs = _rows_of(probs, live_cut)
            for j, token in zip(live_cut, _inverse_cdf(live_probs, uniforms_cut).tolist()):
                token_ids[cut[j]] = token

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
        if any(p.temperature != 1.0 for p in params):  # x / 1.0 is x: skip the pass
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


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) as int64 [N]: the first maximum of each row, a NaN counting
    as the maximum. On a CPU through NumPy, whose vectorised argmax gives the same index (the
    same rule) in 18 us for Gemma 3's 262,144 logits, where torch's took 480 (a decode step's
    3%)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return torch.argmax(logits, dim=-1)
    return torch.from_numpy(logits.numpy().argmax(-1).astype("int64", copy=False))


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits' rows `rows`: the tensor itself when that is every row (no [n, vocab] copy)."""
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits
    return logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]


def _temperature_only(params: SamplingParams, vocab: int) -> bool:
    """A sampling row with no top-k, top-p or min-p cut: softmax at its temperature alone."""
    return ((params.top_k <= 0 or params.top_k >= vocab) and params.top_p >= 1.0
            and params.min_p <= 0.0)


def _masked_by_grammar(
    logits: torch.Tensor, constraints: Sequence[Constraint | FixedMask | None], *,
    in_place: bool = False,
) -> torch.Tensor:
    """logits (a copy unless in_place) with -inf wherever a row's grammar forbids the token.
    Only the constrained rows are touched, so the others' tokens are the same as in a batch
    without grammars."""
    active = [(i, c) for i, c in enumerate(constraints) if c is not None and not c.is_terminated]
    if not active:
        return logits
    allowed = allowed_token_masks([c for _, c in active], logits.shape[-1], logits.device)
    forbidden = ~allowed  # [n, vocab]
    masked = logits if in_place else logits.clone()
    for j, (row, _) in enumerate(active):  # row views, filled in place: no gather/scatter copies
        masked[row].masked_fill_(forbidden[j], float("-inf"))
    return masked


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row j's token: the first index whose cumulative mass exceeds uniforms[j] * the row's mass.

    probs [n, vocab] >= 0 (need not sum to 1); uniforms [n] in [0, 1). A token of zero
    probability is never drawn (the cumulative mass does not rise at it). The cumsum is fp32,
    like the probabilities (float64 took 14 ms for 64 x 49,152, fp32 1.3): a token whose mass is
    below fp32's resolution of the running total (~1e-7 of it) may never be drawn.
    """
    cdf = torch.cumsum(probs, dim=-1)  # [n, vocab]
    targets = (uniforms * cdf[:, -1])[:, None]  # [n, 1]
    index = torch.searchsorted(cdf, targets, right=True)[:, 0]
    return index.clamp_(max=probs.shape[-1] - 1)
