"""ModelRunner: turns a SchedulerOutput into one forward pass over the paged cache, then samples.

Invariant: block copies, then KV store loads, run before the forward; each layer writes the
step's K/V into its pages before attention reads them; logits are computed only for positions
that sample.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvmemo.attention.backend import AttentionBackend, select_attention_backend
from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.engine.sampler import SampledToken, Sampler
from kvmemo.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from kvmemo.connector.base import KVConnector

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled: dict[str, SampledToken]  # request_id -> its new token, for sequences that sampled


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
        attention_backend: AttentionBackend | None = None,
        kv_connector: KVConnector | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.scale = scale
        self.device = device
        self.attention_backend = attention_backend or select_attention_backend("paged", scale)
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
        tokens = self.sampler.sample(
            logits,
            [seqs[i].sampling_params for i in sampling],
            [seqs[i].num_output_tokens for i in sampling],
        )
        return ModelRunnerOutput(sampled={seqs[i].request_id: t for i, t in zip(sampling, tokens)})

    def _attention_fn(self, metadata: AttentionMetadata):
        backend, kv_cache = self.attention_backend, self.kv_cache

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return backend.forward(layer, q, k, v, kv_cache, metadata)  # writes K/V, then attends

        return attention
