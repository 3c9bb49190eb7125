"""A CPU decode step's layers in one C call (model/kernels/layer_chain.c), the CPU's counterpart
of CUDA graphs: the runner asks run() first and takes the step's usual path when it answers None.

Invariant: run() returns the hidden states LlamaForCausalLM.forward returns for the step, bit for
bit: the chain calls the same kernels with the same arguments as the layers' fused steps
(models/llama_fast.FusedLayerStep) and the batch-invariant attention (attention/invariant.py's
write-and-decode call), in the same order. It serves decode steps (one new token per sequence)
of a model whose every layer takes a fused step (native weights, fp32), with the default
batch-invariant paged attention over fp32 pages on the CPU; anything else is None.
Why: on a 2-core AVX2 machine a SmolLM2 decode step spent about a third of its time in the
Python between its ~120 kernel calls (docs/benchmarks.md, "Back on an AVX2 machine").
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import torch

from kvmemo.attention.backend import AttentionBackend, PagedAttentionBackend
from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.invariant import RowPlan
from kvmemo.attention.kernels.paged_decode import KV_DTYPE_CODES, load_decode_kernel
from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.attention.step_checks import check_metadata_fits_cache
from kvmemo.model.kernels.layer_chain import (
    ChainGroup,
    ChainLayer,
    ChainModel,
    chain_function,
    function_address,
)
from kvmemo.model.kernels.quant_int8 import kernel_library
from kvmemo.model.models.llama import LlamaForCausalLM
from kvmemo.model.models.llama_fast import FusedLayerStep
from kvmemo.model.models.llama_layer import DecoderLayer

T = TypeVar("T")


class DecodeChain:
    """One model's layers, weights and pages as layer_chain.c's structs, built once."""

    def __init__(self, model: LlamaForCausalLM, steps: list[FusedLayerStep],
                 kv_cache: PagedKVCache, scale: float) -> None:
        library, decode_kernel, function = kernel_library(), load_decode_kernel(), chain_function()
        assert library is not None and decode_kernel is not None and function is not None
        self.model, self.kv_cache, self.function = model, kv_cache, function
        self.steps = steps  # keeps the weights and norms the structs point into alive
        first = steps[0]
        self.layers = (ChainLayer * len(steps))()
        for index, step in enumerate(steps):
            half = step.head_dim // 2
            rope = (torch.zeros(1, half), torch.zeros(1, half), step.q_size + step.kv_size,
                    step.head_dim)
            post_o, post_mlp = step.post_norms if step.post_norms is not None else (None, None)
            self.layers[index] = ChainLayer(
                qkv=ctypes.addressof(step.qkv.struct), o_proj=ctypes.addressof(step.o.struct),
                gate_up=ctypes.addressof(step.gate_up.struct),
                down=ctypes.addressof(step.down.struct),
                qkv_options=step.qkv.step_options(step.qkv_options(rope)),
                mlp_norm=step.mlp_norm.data_ptr(),
                post_o_norm=None if post_o is None else post_o.data_ptr(),
                post_mlp_norm=None if post_mlp is None else post_mlp.data_ptr(),
                eps=step.mlp_eps, gelu=int(step.gelu),
                k_pages=kv_cache.k_pages[index].data_ptr(),
                v_pages=kv_cache.v_pages[index].data_ptr(),
            )
        num_kv_heads, num_blocks, block_size, _ = kv_cache.k_pages[0].shape
        self.chain = ChainModel(
            linear=function_address(library.linear),
            mlp_block=function_address(library.mlp_block),
            attend=function_address(decode_kernel.write_fn),
            num_layers=len(steps), hidden=first.o.num_out, q_size=first.q_size,
            kv_size=first.kv_size, num_heads=first.num_heads, num_kv_heads=num_kv_heads,
            head_dim=first.head_dim, block_size=block_size, num_blocks=num_blocks,
            kv_dtype=KV_DTYPE_CODES[kv_cache.dtype], scale=scale, layers=self.layers,
        )
        self.page_address = kv_cache.k_pages[0].data_ptr()
        # A query of the model's heads, for RowPlan's check that the decode kernel takes them.
        self.probe_q = torch.empty(0, first.num_heads, first.head_dim)
        self.layer_tables: tuple[int, ...] = ()  # each layer's RoPE table and group, as set
        self.layer_groups: tuple[int, ...] = ()

    @classmethod
    def build(cls, model: object, kv_cache: PagedKVCache,
              backend: AttentionBackend, scale: float) -> DecodeChain | None:
        """The chain for this model, cache and backend, or None where it does not serve them."""
        if not isinstance(model, LlamaForCausalLM):  # a LLaVA's steps may carry images
            return None
        layers = cast("list[DecoderLayer]", list(model.layers))
        steps = [layer.fused_step for layer in layers]
        kernel = load_decode_kernel()
        if (
            model.dense_forward is not None
            or not all(isinstance(step, FusedLayerStep) for step in steps)
            or not isinstance(backend, PagedAttentionBackend) or not backend.batch_invariant
            or kv_cache.is_fp8 or kv_cache.dtype != torch.float32
            or kv_cache.k_pages[0].device.type != "cpu" or len(kv_cache.k_pages) != len(layers)
            or not all(p.is_contiguous() for p in (*kv_cache.k_pages, *kv_cache.v_pages))
            or kernel is None or chain_function() is None or kernel_library() is None
        ):
            return None
        fused = cast("list[FusedLayerStep]", steps)
        first = fused[0]
        q = torch.empty(1, first.num_heads, first.head_dim)
        kv = torch.empty(1, first.num_kv_heads, first.head_dim)
        if not (kernel.supports(q, kv_cache.k_pages[0], kv_cache.v_pages[0])
                and kernel.write_fits(q, kv, kv)
                and all((s.q_size, s.kv_size, s.num_heads, s.num_kv_heads, s.head_dim)
                        == (first.q_size, first.kv_size, first.num_heads, first.num_kv_heads,
                            first.head_dim) for s in fused)):
            return None
        return cls(model, fused, kv_cache, scale)

    def run(self, ids: torch.Tensor, positions: torch.Tensor,
            layer_metadata: Sequence[AttentionMetadata]) -> torch.Tensor | None:
        """The final-normed hidden states [B, hidden] of a decode step (ids, positions [B]), its
        K/V written; None when the step is not one the chain serves (nothing is written)."""
        plans: list[RowPlan] = []  # what the groups point into, alive through the call
        groups, layer_groups = self._groups(layer_metadata, plans)
        if groups is None or self.kv_cache.k_pages[0].data_ptr() != self.page_address:
            return None
        rows = ids.shape[0]
        tables = self.model.rope_tables(positions, torch.float32)  # per layer: [B, 1, D/2] x 2
        unique, layer_tables = _distinct(tables, key=lambda pair: id(pair[0]))
        if any(t.dtype != torch.float32 or not t.is_contiguous() for pair in unique for t in pair):
            return None
        if layer_tables != self.layer_tables or layer_groups != self.layer_groups:
            for layer, (table, group) in enumerate(zip(layer_tables, layer_groups)):
                self.layers[layer].rope, self.layers[layer].group = table, group
            self.layer_tables, self.layer_groups = layer_tables, layer_groups
        cos = (ctypes.c_void_p * len(unique))(*(c.data_ptr() for c, _ in unique))
        sin = (ctypes.c_void_p * len(unique))(*(s.data_ptr() for _, s in unique))
        hidden = self.model.embed(ids).contiguous()  # [B, hidden] fp32
        out = torch.empty_like(hidden)
        failed = ctypes.c_int64(-1)
        status = self.function(ctypes.byref(self.chain), rows, hidden.data_ptr(), out.data_ptr(),
                               cos, sin, groups, ctypes.byref(failed))
        if status == 3:
            raise MemoryError(f"decode step in C: no memory at layer {failed.value}")
        if status != 0:
            raise RuntimeError(f"decode step in C: status {status} at layer {failed.value}")
        return self.model.norm(out)

    def _groups(self, layer_metadata: Sequence[AttentionMetadata], plans: list[RowPlan],
                ) -> tuple[ctypes.Array[ChainGroup] | None, tuple[int, ...]]:
        """The step's attention groups (one per distinct metadata, its RowPlan appended to
        `plans`) and each layer's, or None when a group is not a decode step the batch-invariant
        write-and-decode call serves."""
        distinct, layer_groups = _distinct(layer_metadata)
        groups = (ChainGroup * len(distinct))()
        # A plan's lengths and window starts follow from the rows' lengths and the window alone:
        # groups that share them (AttentionMetadata.for_tables: Gemma 3's five sliding groups)
        # share one plan.
        plan_of: dict[tuple[int, int | None], RowPlan | None] = {}
        for i, metadata in enumerate(distinct):
            if (any(n != 1 for n in metadata.query_lens)
                    or metadata.slot_mapping.dtype != torch.int64):
                return None, layer_groups
            check_metadata_fits_cache(metadata, self.kv_cache)
            key = (id(metadata.seq_lens_t), metadata.sliding_window)
            if key not in plan_of:
                plan_of[key] = RowPlan.build(metadata, self.kv_cache, self.probe_q)
            plan = plan_of[key]
            tables = metadata.block_tables
            if (plan is None or plan.table_rows is not None or tables.dtype != torch.int64
                    or not tables.is_contiguous() or not metadata.slot_mapping.is_contiguous()):
                return None, layer_groups
            groups[i] = ChainGroup(
                slots=metadata.slot_mapping.data_ptr(), block_tables=tables.data_ptr(),
                kv_lens=plan.kv_lens.data_ptr(),
                kv_starts=None if plan.kv_starts is None else plan.kv_starts.data_ptr(),
                table_stride=tables.shape[1],
            )
            plans.append(plan)
        return groups, layer_groups


def _distinct(items: Sequence[T], key: Callable[[T], int] = id,
              ) -> tuple[list[T], tuple[int, ...]]:
    """The distinct items (by `key`, in first-seen order) and each item's index among them."""
    index: dict[int, int] = {}
    distinct: list[T] = []
    for item in items:
        if index.setdefault(key(item), len(distinct)) == len(distinct):
            distinct.append(item)
    return distinct, tuple(index[key(item)] for item in items)
