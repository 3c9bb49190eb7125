"""CUDA graphs for decode steps: one captured model forward per batch-size bucket, replayed.

A decode step of a small model is launch-bound on a GPU: hundreds of kernel launches from
Python for microseconds of work each. A graph replays them all in one launch. Each bucket's
graph reads its inputs from static device buffers; a step of n sequences copies its token ids,
positions, slots, block tables and lengths into the smallest bucket >= n, pads the rest (slot -1:
no K/V write; length 1: one harmless key), replays, and keeps the first n rows.

Invariant: a replay attends with the same bits as the eager step. The graphs attend with the
Triton backend in split mode over a fixed number of key segments (the model's limit; unsplit
where their partial states would pass SPLIT_PARTIALS_BUDGET); the kernels merge segment states
identically whatever the split (attention/kernels/triton_attention.py), and padded rows never
enter a real row's attention. The linear layers are the Triton GEMM (model/kernels/
triton_linear.py), one tiling per weight whatever the row count, so padding rows move no bit of
a real row either (with cuBLAS's GEMMs, KVMEMO_LINEAR_KERNEL=torch, they did: logprobs within
1e-4 on an H200). Graphs are captured lazily, a bucket the first
time a step needs it, and only where every step input is static: one layer group (no sliding
windows), the Triton backend, CUDA. A capture that fails turns graphs off with one warning.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.metadata import AttentionMetadata

if TYPE_CHECKING:  # triton_attention imports triton (slow): only a runner on CUDA loads it
    from kvmemo.attention.kernels.triton_attention import TilePlan

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# Split mode's partial softmax states (per tile, kv head and segment of the model's whole
# length) within this many bytes, else a bucket's graph attends unsplit: the same bits, fewer
# programs (a long-context model's batch-64 partials would take gigabytes).
SPLIT_PARTIALS_BUDGET = 256 << 20


def graph_batch_size(num_seqs: int, sizes: tuple[int, ...] = GRAPH_BATCH_SIZES) -> int | None:
    """The smallest bucket that holds num_seqs sequences, or None when none does."""
    return next((size for size in sizes if size >= num_seqs), None)


@dataclass
class StaticDecodeInputs:
    """The device buffers every graph reads, sized for the largest bucket; bucket b reads the
    first b rows."""

    tokens: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64; -1 on padded rows: the KV write skips them
    block_tables: torch.Tensor  # [B, W] int64, W = blocks of the longest sequence allowed
    seq_lens: torch.Tensor  # [B] int64

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> StaticDecodeInputs:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(zeros(max_batch), zeros(max_batch), zeros(max_batch) - 1,
                   zeros(max_batch, max_blocks), zeros(max_batch) + 1)

    def fill(self, ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
             size: int) -> None:
        """This step's n sequences into rows [0, n), padding into [n, size); device copies only
        (no host sync)."""
        n = ids.shape[0]
        width = metadata.block_tables.shape[1]
        self.tokens[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        self.seq_lens[:n].copy_(metadata.seq_lens_t)
        self.pad(n, size)

    def pad(self, n: int, size: int) -> None:
        """Rows [n, size) as padding: token 0 at position 0, no K/V write, one key."""
        if size > n:
            self.tokens[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, hidden] the captured forward's output
    # What the captured kernels read besides the static inputs (the tile plan's tensors, the
    # metadata's query lengths): held here, or their memory would be freed and reused while
    # the graph still reads it.
    metadata: AttentionMetadata
    plan: TilePlan


class DecodeGraphs:
    """Owns the captured decode graphs of one ModelRunner and their static inputs."""

    def __init__(self, model: Any, kv_cache: PagedKVCache, backend: Any, max_model_len: int,
                 max_num_seqs: int, num_heads: int):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        device = kv_cache.k_pages[0].device
        self.device = device
        self.sizes = tuple(s for s in GRAPH_BATCH_SIZES if s < max_num_seqs) + (
            (graph_batch_size(max_num_seqs) or max_num_seqs),)
        from kvmemo.attention.kernels.triton_attention import SEGMENT

        self.max_blocks = math.ceil(max_model_len / kv_cache.block_size)
        self.num_segments = math.ceil(max_model_len / SEGMENT)
        self.inputs = StaticDecodeInputs.allocate(self.sizes[-1], self.max_blocks, device)
        self.group = num_heads // kv_cache.num_kv_heads
        self.graphs: dict[int, _Graph] = {}
        self.pool: Any = None
        self.enabled = True

    def run(self, ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states [n, hidden] by graph replay, or None when graphs do not
        apply (the caller runs the eager forward)."""
        size = graph_batch_size(ids.shape[0], self.sizes)
        if not self.enabled or size is None or metadata.block_tables.shape[1] > self.max_blocks:
            return None
        graph = self.graphs.get(size)
        if graph is None:
            graph = self._capture(size)
            if graph is None:
                return None
        self.inputs.fill(ids, positions, metadata, size)
        graph.graph.replay()
        return graph.hidden[: ids.shape[0]]

    def _static_metadata(self, size: int) -> tuple[AttentionMetadata, TilePlan]:
        from kvmemo.attention.kernels.triton_attention import TilePlan, rows_per_tile

        inputs, device = self.inputs, self.device
        metadata = AttentionMetadata(
            slot_mapping=inputs.slot_mapping[:size],
            block_tables=inputs.block_tables[:size],
            query_start_loc=list(range(size + 1)),
            query_lens=[1] * size,
            seq_lens=[1] * size,  # the graph reads seq_lens_t; the host list is never read
            block_size=self.kv_cache.block_size,
            query_lens_t=torch.ones(size, dtype=torch.int64, device=device),
            seq_lens_t=inputs.seq_lens[:size],
            num_cache_blocks=self.kv_cache.num_blocks,
        )
        block_m = rows_per_tile(self.group, device)
        arange = torch.arange(size, dtype=torch.int32, device=device)
        plan = TilePlan(
            block_m=block_m, tokens_per_tile=block_m // self.group, tile_seq=arange,
            tile_q0=torch.zeros_like(arange), query_start=arange,
            query_lens=torch.ones_like(arange), seq_lens=inputs.seq_lens[:size],
            num_segments=self.num_segments,
        )
        return metadata, plan

    def _capture(self, size: int) -> _Graph | None:
        metadata, plan = self._static_metadata(size)
        backend, kv_cache, inputs = self.backend, self.kv_cache, self.inputs
        inputs.pad(0, size)

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            return backend.forward(layer, q, k, v, kv_cache, metadata)

        head_dim = kv_cache.k_pages[0].shape[-1]
        partial_bytes = (size * kv_cache.num_kv_heads * plan.num_segments * plan.block_m
                         * (1 << max(0, head_dim - 1).bit_length()) * 4)
        split = partial_bytes <= SPLIT_PARTIALS_BUDGET

        def forward() -> torch.Tensor:
            backend.use_static_plan(metadata, plan, split=split)
            return self.model(inputs.tokens[:size], inputs.positions[:size], attention)

        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the kernels, allocates what is lazy
                    forward()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = forward()
            self.pool = graph.pool()
        except Exception as error:  # noqa: BLE001 - any capture failure: eager from now on
            logger.warning("CUDA graphs off: capturing the decode step of %d sequences failed "
                           "(%s); decode steps run eagerly", size, error)
            self.enabled = False
            return None
        finally:
            backend.use_static_plan(None, None, split=None)
        captured = _Graph(graph, hidden, metadata, plan)
        self.graphs[size] = captured
        return captured


def decode_graphs_apply(device: torch.device, backend_name: str, num_groups: int,
                        enforce_eager: bool) -> bool:
    """Whether a runner on `device` captures decode graphs at all."""
    return (device.type == "cuda" and backend_name == "triton" and num_groups <= 1
            and not enforce_eager)

