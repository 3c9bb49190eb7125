"""ModelRunner: turns a SchedulerOutput into one forward pass over the paged cache, then samples.

Invariant: block copies, then KV store loads, run before the forward; image features replace
exactly the placeholder rows the step computes; each layer writes the step's K/V into its pages
before attention reads them; logits are computed only for positions that sample.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvmemo.attention.backend import AttentionBackend, select_attention_backend
from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.engine.blend_forward import blend_prefill
from kvmemo.engine.draft_verify import accepted, draft_rows
from kvmemo.engine.encoder_cache import EncoderCache
from kvmemo.engine.sampler import SampledToken, Sampler
from kvmemo.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from kvmemo.host_copy import to_device
from kvmemo.kv.layout import KVGroup

if TYPE_CHECKING:
    from kvmemo.connector.base import KVConnector
    from kvmemo.engine.cuda_graphs import DecodeGraphs
    from kvmemo.engine.decode_chain import DecodeChain

logger = logging.getLogger(__name__)

_PROMPT_LOGITS_ROWS = 256  # prompt positions whose logits are computed at once


@dataclass(frozen=True)
class ModelRunnerOutput:
    # request_id -> its new tokens, for sequences that sampled: one, or after a draft, the
    # kept draft tokens and the one that follows them (kvmemo/engine/draft_verify.py)
    sampled: dict[str, list[SampledToken]]
    # request_id -> [vocab] fp32 log_softmax of the last position, for sequences that asked for
    # it instead of a token (return_logprobs_row).
    logprobs_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    # request_id -> (prompt position of the first entry, one {token_id: logprob} per prompt
    # token from there, holding that token and the top-k alternatives), for the sequences whose
    # chunk computed prompt positions and that asked for prompt logprobs.
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # request_id -> prompt tokens whose KV was reused from chunks, for blended prefills.
    blend_counts: dict[str, int] = field(default_factory=dict)


class ModelRunner:
    """Owns the model, the paged KV cache and the sampler for one device."""

    def __init__(
        self,
        # A Llama or LLaVA module: forward, compute_logits, embed_tokens, encode_images. Typed
        # Any because torch types nn.Module attributes as Tensor | Module.
        model: Any,
        kv_cache: PagedKVCache,
        sampler: Sampler,
        *,
        scale: float,
        device: torch.device,
        attention_backend: AttentionBackend | None = None,
        kv_connector: KVConnector | None = None,
        encoder_cache: EncoderCache | None = None,
        kv_groups: Sequence[KVGroup] = (),
        vocab_size: int = 0,
    ):
        self.model = model
        self.vocab_size = vocab_size  # a grammar mask's width, for a draft's rows
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.scale = scale
        self.attention_backend = attention_backend or select_attention_backend(
            "auto", scale, device
        )
        self.kv_connector = kv_connector  # worker side: loads store blocks into the pages
        if kv_connector is not None:
            kv_connector.register_kv_caches(kv_cache)
        self.encoder_cache = encoder_cache  # image features by content hash (multimodal models)
        # The layout's layer groups: several for a hybrid (sliding-window) model, whose layers
        # each read their group's block tables; empty or one group: every layer reads the same.
        self.kv_groups = tuple(kv_groups)
        self.group_of_layer = {
            layer: g for g, group in enumerate(self.kv_groups) for layer in group.layer_indices
        }
        # CUDA: decode steps replay captured graphs (cuda_graphs.py); set by the engine.
        self.decode_graphs: DecodeGraphs | None = None
        # CPU: decode steps' layers in one C call (decode_chain.py); set by the engine.
        self.decode_chain: DecodeChain | None = None
        # Debug hook for tests: keep the last step's sampling logits.
        self.capture_logits = False
        self.last_logits: torch.Tensor | None = None
        self.last_blend_logits: tuple[torch.Tensor, torch.Tensor] | None = None

    def track_block_generations(self, generations: Sequence[int]) -> None:
        """Lets attention keep work derived from full blocks (packed shared prefixes) across
        steps while their allocation generations stand (BlockPool.generations)."""
        packs = getattr(self.attention_backend, "prefix_packs", None)
        if packs is not None:
            packs.generations = generations

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        if output.block_copies:
            self.kv_cache.copy_block_prefixes(output.block_copies)
        if self.kv_connector is not None and output.kv_connector_metadata is not None:
            self.kv_connector.start_load_kv(output.kv_connector_metadata)
        if output.is_empty:
            return ModelRunnerOutput(sampled={})
        blends = [s for s in output.sequences if s.blend is not None]
        if blends:
            return self._execute_with_blends(output, blends)
        return self._execute(output.sequences)

    def _execute_with_blends(
        self, output: SchedulerOutput, blends: list[ScheduledSequence]
    ) -> ModelRunnerOutput:
        """Blended prefills run one by one (blend_forward.py), the rest as one batch; each
        blend's last row is sampled like any prompt's."""
        rest = [s for s in output.sequences if s.blend is None]
        result = self._execute(rest) if rest else ModelRunnerOutput(sampled={})
        counts: dict[str, int] = {}
        sampled = dict(result.sampled)
        for seq in blends:
            blended = blend_prefill(
                self.model, self.kv_cache, self.attention_backend, seq,
                scale=self.scale, device=self.device,
            )
            counts[seq.request_id] = blended.num_reused_tokens
            logits = self.model.compute_logits(blended.hidden[-1:]).float()
            if self.capture_logits:
                self.last_logits = logits.clone()
                # Every recomputed row's logits, by position (teacher-forced benchmarks).
                self.last_blend_logits = (
                    blended.positions.cpu(), self.model.compute_logits(blended.hidden).float()
                )
            (token,) = self.sampler.sample(
                logits, [seq.sampling_params], [seq.num_output_tokens],
                [seq.token_history], [seq.constraint],
            )
            sampled[seq.request_id] = [token]
        return dataclasses.replace(result, sampled=sampled, blend_counts=counts)

    def _execute(self, seqs: list[ScheduledSequence]) -> ModelRunnerOutput:
        input_ids: list[int] = []
        positions: list[int] = []
        for seq in seqs:
            input_ids.extend(seq.token_ids)
            start = seq.num_computed_tokens
            positions.extend(range(start, start + len(seq.token_ids)))
        metadata = AttentionMetadata.build(
            block_tables=[s.block_table for s in seqs],
            num_computed_tokens=[s.num_computed_tokens for s in seqs],
            query_lens=[len(s.token_ids) for s in seqs],
            block_size=self.kv_cache.block_size,
            num_cache_blocks=self.kv_cache.num_blocks,
            device=self.device,
        )
        # The rows that sample: each sequence's last, or a drafted sequence's last
        # len(draft) + 1, each as a view of its sequence at that point of the draft.
        rows: list[ScheduledSequence] = []
        row_of: list[int] = []  # the sampled rows' indices in the batch
        owner: list[int] = []  # the sequence (index into seqs) of each sampled row
        for i, seq in enumerate(seqs):
            if seq.needs_sample:
                views = draft_rows(seq, self.vocab_size)
                end = metadata.query_start_loc[i + 1]
                rows.extend(views)
                row_of.extend(range(end - len(views), end))
                owner.extend([i] * len(views))
        ids, positions_t, last_rows = to_device(  # [T], [T], [N]: one copy on a GPU
            [torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
             torch.tensor(row_of, dtype=torch.int64)], self.device)
        multimodal = self._multimodal_embeds(seqs, ids, metadata)
        hidden = None
        decoding = not multimodal and len(ids) == len(seqs)  # one new token per sequence
        if self.decode_graphs is not None and decoding:
            hidden = self.decode_graphs.run(ids, positions_t, metadata)  # None: not this step
        layer_metadata = None
        if hidden is None and self.decode_chain is not None and decoding:
            layer_metadata = self._layer_metadata(seqs, metadata)
            hidden = self.decode_chain.run(ids, positions_t, layer_metadata)  # None: not this step
        if hidden is None:
            hidden = self.model(
                ids, positions_t,
                self._attention_fn(layer_metadata or self._layer_metadata(seqs, metadata)),
                **multimodal,
            )  # [T, hidden]
        prompt_logprobs = (
            self._prompt_logprobs(hidden, seqs, metadata)
            if any(s.prompt_token_ids is not None for s in seqs) else {}
        )
        if not rows:
            return ModelRunnerOutput(sampled={}, prompt_logprobs=prompt_logprobs)
        hidden = hidden.index_select(0, last_rows)  # [N, hidden]
        if not self.capture_logits and all(_plain_greedy(row) for row in rows):
            greedy = self._greedy_tokens(hidden)
            if greedy is not None:
                tokens = [SampledToken(t, None, None) for t in greedy]
                return ModelRunnerOutput(sampled=_kept(seqs, owner, tokens),
                                         prompt_logprobs=prompt_logprobs)
        logits = self._logits(hidden, rows)  # [N, vocab] fp32
        if self.capture_logits:
            self.last_logits = logits.clone()
        logprobs_rows: dict[str, torch.Tensor] = {}
        if any(row.return_logprobs_row for row in rows):  # beams: never drafted
            logits, left, logprobs_rows = self._split_rows(logits, list(range(len(rows))), rows)
            rows, owner = [rows[r] for r in left], [owner[r] for r in left]
        tokens = self.sampler.sample(
            logits,
            [row.sampling_params for row in rows],
            [row.num_output_tokens for row in rows],
            [row.token_history for row in rows],
            [row.constraint for row in rows],
        ) if rows else []
        return ModelRunnerOutput(
            sampled=_kept(seqs, owner, tokens), logprobs_rows=logprobs_rows,
            prompt_logprobs=prompt_logprobs,
        )

    def _logits(self, hidden: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
        """Each row's fp32 logits: the model's sampling_logits for rows sampled at a temperature
        that return no logprobs (the bf16 mode's bf16 head), compute_logits for the others.
        Chosen per row, so a seeded request's tokens do not depend on its neighbours."""
        # Only a model whose sampling head differs splits the rows (else one head product).
        if self.capture_logits or not getattr(self.model, "has_sampling_head", False):
            return self.model.compute_logits(hidden).float()
        sampling_logits = self.model.sampling_logits
        plain = [row for row, seq in enumerate(seqs) if _plain_sampled(seq)]
        if not plain:
            return self.model.compute_logits(hidden).float()
        if len(plain) == len(seqs):
            return sampling_logits(hidden).float()
        plain_set = set(plain)
        exact = [row for row in range(len(seqs)) if row not in plain_set]
        plain_rows = torch.tensor(plain, device=hidden.device)
        exact_rows = torch.tensor(exact, device=hidden.device)
        first = sampling_logits(hidden.index_select(0, plain_rows)).float()
        logits = first.new_empty(len(seqs), first.shape[1])
        logits.index_copy_(0, plain_rows, first)
        logits.index_copy_(
            0, exact_rows, self.model.compute_logits(hidden.index_select(0, exact_rows)).float()
        )
        return logits

    def _greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """The argmax token of each row's fp32 logits through the model's greedy head (without
        the full fp32 head product), or None when the model has none."""
        greedy_tokens = getattr(self.model, "greedy_tokens", None)
        tokens = None if greedy_tokens is None else greedy_tokens(hidden)
        if tokens is None:
            return None
        unresolved = (tokens < 0).nonzero().flatten()
        if unresolved.numel():  # a non-finite logit: the full head decides, as the sampler would
            full = self.model.compute_logits(hidden.index_select(0, unresolved)).float()
            tokens[unresolved] = full.argmax(dim=-1)
        return tokens.tolist()

    def _prompt_logprobs(
        self, hidden: torch.Tensor, seqs: list[ScheduledSequence], metadata: AttentionMetadata
    ) -> dict[str, tuple[int, list[dict[int, float]]]]:
        """Each asking sequence's chunk positions p that predict a prompt token: log p(prompt[p+1]
        | prompt[:p+1]) and the top-k, from fp32 log_softmax of the full logits row (as HF)."""
        out: dict[str, tuple[int, list[dict[int, float]]]] = {}
        for i, seq in enumerate(seqs):
            prompt = seq.prompt_token_ids
            if prompt is None:
                continue
            start = seq.num_computed_tokens
            end = min(start + len(seq.token_ids), len(prompt) - 1)
            k = seq.sampling_params.prompt_logprobs or 0
            entries: list[dict[int, float]] = []
            row0 = metadata.query_start_loc[i] - start  # batch row of position 0
            # A few hundred rows of vocabulary-wide logits at a time (256 x 49,152 fp32: 50 MB).
            for lo in range(start, end, _PROMPT_LOGITS_ROWS):
                hi = min(lo + _PROMPT_LOGITS_ROWS, end)
                logits = self.model.compute_logits(hidden[row0 + lo : row0 + hi]).float()
                logprobs = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(prompt[lo + 1 : hi + 1], device=logprobs.device)
                chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
                top_values, top_ids = torch.topk(logprobs, k) if k else (None, None)
                for j, token in enumerate(targets.tolist()):
                    entry = (
                        dict(zip(top_ids[j].tolist(), top_values[j].tolist()))
                        if top_ids is not None and top_values is not None else {}
                    )
                    entry[token] = chosen[j]
                    entries.append(entry)
            if entries:
                out[seq.request_id] = (start + 1, entries)
        return out

    @staticmethod
    def _split_rows(
        logits: torch.Tensor, sampling: list[int], seqs: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, list[int], dict[str, torch.Tensor]]:
        """The rows that return log-probabilities become fp32 log_softmax (as HF's beam search,
        in one call); returns the logits left to sample, their sequence indices, and the rows."""
        row_of = [row for row, i in enumerate(sampling) if seqs[i].return_logprobs_row]
        sample_rows = [row for row, i in enumerate(sampling) if not seqs[i].return_logprobs_row]
        device = logits.device
        logprobs = torch.log_softmax(logits[torch.tensor(row_of, device=device)], dim=-1)
        rows = {seqs[sampling[row]].request_id: logprobs[k] for k, row in enumerate(row_of)}
        rest = logits[torch.tensor(sample_rows, dtype=torch.int64, device=device)]
        return rest, [sampling[row] for row in sample_rows], rows

    def _multimodal_embeds(
        self, seqs: list[ScheduledSequence], ids: torch.Tensor, metadata: AttentionMetadata
    ) -> dict[str, torch.Tensor]:
        """{"inputs_embeds": [T, hidden]} with image features in the placeholder rows this step
        computes, or {} for a text-only step. Encodes, in one batch, the images not cached."""
        if not any(seq.mm_inputs for seq in seqs):
            return {}
        cache = self.encoder_cache
        assert cache is not None, "image inputs reached a runner without an encoder cache"
        features: dict[bytes, torch.Tensor] = {}  # held for this step even if the cache evicts
        to_encode: dict[bytes, Any] = {}
        for seq in seqs:
            for item, pixels in seq.mm_inputs:
                key = item.content_hash
                if key in features or key in to_encode:
                    continue
                cached = cache.get(key)
                if cached is not None:
                    features[key] = cached
                else:
                    to_encode[key] = pixels
        if to_encode:
            pixel_values = torch.from_numpy(np.stack(list(to_encode.values())))  # [N, 3, S, S]
            pixel_values = pixel_values.to(self.device)
            encoded = self.model.encode_images(pixel_values)  # [N, num_image_tokens, hidden]
            cache.stats.num_encoder_calls += 1
            cache.stats.num_encoded_images += len(to_encode)
            for key, rows in zip(to_encode, encoded):
                features[key] = rows
                cache.put(key, rows)
        embeds = self.model.embed_tokens(ids)  # [T, hidden]
        for index, seq in enumerate(seqs):
            chunk_start = seq.num_computed_tokens
            chunk_end = chunk_start + len(seq.token_ids)
            row0 = metadata.query_start_loc[index] - chunk_start  # batch row of position 0
            for item, _ in seq.mm_inputs:
                lo, hi = max(chunk_start, item.offset), min(chunk_end, item.end)
                # Chunked prefill may cover only part of an image: copy just the rows it computes.
                rows = features[item.content_hash][lo - item.offset : hi - item.offset]
                embeds[row0 + lo : row0 + hi] = rows
        return {"inputs_embeds": embeds}

    def _layer_metadata(
        self, seqs: list[ScheduledSequence], metadata: AttentionMetadata
    ) -> list[AttentionMetadata]:
        """The metadata each layer attends with: `metadata` for a single-group layout, else its
        group's (that group's block tables; a sliding group's cropped to its window)."""
        num_layers = len(self.kv_cache.k_pages)
        if len(self.kv_groups) <= 1:
            return [metadata] * num_layers
        computed = [s.num_computed_tokens for s in seqs]
        by_window: dict[int | None, AttentionMetadata] = {}  # the first group of each window
        by_group: list[AttentionMetadata] = []
        for g, group in enumerate(self.kv_groups):
            window = group.sliding_window
            if g == 0 and window is None:
                # Group 0 is the full-attention group: its tables are the ones `metadata` holds.
                group_metadata = metadata
            elif window in by_window:  # Gemma 3's five sliding groups: their rows built once
                group_metadata = by_window[window].for_tables(
                    [s.group_block_tables[g] for s in seqs], computed)
            else:
                group_metadata = AttentionMetadata.build(
                    block_tables=[s.group_block_tables[g] for s in seqs],
                    num_computed_tokens=computed,
                    query_lens=[len(s.token_ids) for s in seqs],
                    block_size=self.kv_cache.block_size,
                    num_cache_blocks=self.kv_cache.num_blocks,
                    device=self.device,
                    sliding_window=window,
                )
            by_window.setdefault(window, group_metadata)
            by_group.append(group_metadata)
        return [by_group[self.group_of_layer[layer]] for layer in range(num_layers)]

    def _attention_fn(self, layer_metadata: list[AttentionMetadata]):
        backend, kv_cache = self.attention_backend, self.kv_cache

        def attention(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            # Writes K/V, then attends.
            return backend.forward(layer, q, k, v, kv_cache, layer_metadata[layer])

        return attention


def _kept(
    seqs: list[ScheduledSequence], owner: list[int], tokens: list[SampledToken]
) -> dict[str, list[SampledToken]]:
    """Each sequence's new tokens from its sampled rows (in order, `owner` naming each row's
    sequence): the one token, or a draft's kept prefix and the token after it."""
    by_seq: dict[int, list[SampledToken]] = {}
    for i, token in zip(owner, tokens):
        by_seq.setdefault(i, []).append(token)
    return {
        seqs[i].request_id: accepted(seqs[i].draft_token_ids, row_tokens, _token_id)
        for i, row_tokens in by_seq.items()
    }


def _token_id(token: SampledToken) -> int:
    return token.token_id


def _plain_sampled(seq: ScheduledSequence) -> bool:
    """The sequence draws its token at a temperature (not a top-1 cut, which is greedy) and
    reads no log-probabilities."""
    params = seq.sampling_params
    return (not params.is_greedy and params.top_k != 1 and params.logprobs is None
            and not seq.return_logprobs_row)


def _plain_greedy(seq: ScheduledSequence) -> bool:
    """The sequence's token is its logits' argmax and nothing else is read from them."""
    params = seq.sampling_params
    return (params.is_greedy and params.logprobs is None and not params.has_penalties
            and seq.constraint is None and not seq.return_logprobs_row)
