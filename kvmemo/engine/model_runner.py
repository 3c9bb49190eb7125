"""ModelRunner: turns a SchedulerOutput into one forward pass over the paged cache, then samples.

Invariant: block copies, then KV store loads, run before the forward; each layer writes the
step's K/V into its pages before attention reads them; logits are computed only for positions
that sample.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from kvmemo.attention.cache import PagedKVCache, write_kv
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.attention.paged import paged_attention
from kvmemo.engine.sampler import SampledToken, Sampler
from kvmemo.engine.scheduler_output import ScheduledSequence, SchedulerOutput

if TYPE_CHECKING:
    from kvmemo.connector.base import KVConnector

logger = logging.getLogger(__name__)

# backend(q, k_cache, v_cache, metadata, scale) -> [T, Hq, D]
AttentionBackendFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled: dict[str, SampledToken]  # request_id -> its new token, for sequences that sampled
    # Beam search: request_id -> [num beams, vocab] fp32 log_softmax rows, in beam_index order.
    beam_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    """Owns the model, the paged KV cache and the sampler for one device."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        sampler: Sampler,
        *,
        scale: float,
        device: torch.device,
        attention_backend: AttentionBackendFn = paged_attention,
        kv_connector: KVConnector | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.scale = scale
        self.device = device
        self.attention_backend = attention_backend
        self.kv_connector = kv_connector  # worker side: loads store blocks into the pages
        if kv_connector is not None:
            kv_connector.register_kv_caches(kv_cache)
        # Debug hook for tests: keep the last step's sampling logits.
        self.capture_logits = False
        self.last_logits: torch.Tensor | None = None

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        if output.block_copies:
            self.kv_cache.copy_block_prefixes(output.block_copies)
        if self.kv_connector is not None and output.kv_connector_metadata is not None:
            self.kv_connector.start_load_kv(output.kv_connector_metadata)
        if output.is_empty:
            return ModelRunnerOutput(sampled={})
        seqs = output.sequences
        input_ids: list[int] = []
        positions: list[int] = []
        for seq in seqs:
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.num_computed_tokens, seq.num_computed_tokens + len(seq.token_ids)))
        metadata = AttentionMetadata.build(
            block_tables=[s.block_table for s in seqs],
            num_computed_tokens=[s.num_computed_tokens for s in seqs],
            query_lens=[len(s.token_ids) for s in seqs],
            block_size=self.kv_cache.block_size,
            num_cache_blocks=self.kv_cache.num_blocks,
            request_ids=[s.request_id for s in seqs],
            beam_indices=[s.beam_index or 0 for s in seqs],
            device=self.device,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self._attention_fn(metadata),
        )  # [T, hidden]
        sampling = [i for i, s in enumerate(seqs) if s.needs_sample]
        if not sampling:
            return ModelRunnerOutput(sampled={})
        last_rows = torch.tensor([metadata.query_start_loc[i + 1] - 1 for i in sampling], device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, last_rows)).float()  # [N, vocab]
        if self.capture_logits:
            self.last_logits = logits.clone()
        beam_logprobs: dict[str, torch.Tensor] = {}
        if any(seqs[i].beam_index is not None for i in sampling):
            logits, sampling, beam_logprobs = self._split_beams(logits, sampling, seqs)
        tokens = self.sampler.sample(
            logits,
            [seqs[i].sampling_params for i in sampling],
            [seqs[i].num_output_tokens for i in sampling],
        ) if sampling else []
        sampled = {seqs[i].request_id: t for i, t in zip(sampling, tokens)}
        return ModelRunnerOutput(sampled=sampled, beam_logprobs=beam_logprobs)

    @staticmethod
    def _split_beams(
        logits: torch.Tensor, sampling: list[int], seqs: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, list[int], dict[str, torch.Tensor]]:
        """Beam rows become per-request [num beams, vocab] log_softmax (fp32, as HF's beam
        search); returns the logits left to sample, their sequence indices, and the beam rows."""
        rows_of: dict[str, list[tuple[int, int]]] = {}
        sample_rows: list[int] = []
        for row, i in enumerate(sampling):
            beam = seqs[i].beam_index
            if beam is None:
                sample_rows.append(row)
            else:
                rows_of.setdefault(seqs[i].request_id, []).append((beam, row))
        ordered = {rid: [row for _, row in sorted(pairs)] for rid, pairs in rows_of.items()}
        beam_rows = [row for rows in ordered.values() for row in rows]
        device = logits.device
        rows = torch.tensor(beam_rows, device=device)
        logprobs = torch.log_softmax(logits[rows], dim=-1)  # [num beam rows, vocab]
        beam_logprobs = dict(zip(ordered, logprobs.split([len(rows) for rows in ordered.values()])))
        rest = logits[torch.tensor(sample_rows, dtype=torch.int64, device=device)]
        return rest, [sampling[row] for row in sample_rows], beam_logprobs

    def _attention_fn(self, metadata: AttentionMetadata):
        k_caches, v_caches = self.kv_cache.k_caches, self.kv_cache.v_caches
        backend, scale = self.attention_backend, self.scale

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # Write first: queries of this step attend to their own new keys.
            write_kv(k_caches[layer], v_caches[layer], k, v, metadata.slot_mapping)
            return backend(q, k_caches[layer], v_caches[layer], metadata, scale)

        return attention
