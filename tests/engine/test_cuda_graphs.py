"""CUDA graphs' device-agnostic parts, on the CPU: which bucket a step replays, when graphs
apply, and the static inputs a replay reads (rows copied, padding that writes no K/V). Replays
themselves are compared with eager steps on a GPU (tests/gpu/test_cuda_engine.py)."""

from __future__ import annotations

import torch

from kvmemo.attention.metadata import AttentionMetadata
from kvmemo.engine.cuda_graphs import (
    GRAPH_BATCH_SIZES,
    StaticDecodeInputs,
    decode_graphs_apply,
    graph_batch_size,
)


def test_bucket_is_the_smallest_that_holds_the_step() -> None:
    assert [graph_batch_size(n) for n in (1, 2, 3, 5, 9, 17, 25, 33, 49, 64)] == [
        1, 2, 4, 8, 16, 24, 32, 48, 64, 64]
    assert graph_batch_size(65) is None  # past the largest bucket: eager
    assert graph_batch_size(3, (1, 2, 8)) == 8
    assert list(GRAPH_BATCH_SIZES) == sorted(GRAPH_BATCH_SIZES)


def test_graphs_apply_on_cuda_with_triton_and_one_group_only() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert decode_graphs_apply(cuda, "triton", 1, enforce_eager=False)
    assert not decode_graphs_apply(cpu, "triton", 1, enforce_eager=False)
    assert not decode_graphs_apply(cuda, "paged", 1, enforce_eager=False)
    assert not decode_graphs_apply(cuda, "triton", 2, enforce_eager=False)  # sliding groups
    assert not decode_graphs_apply(cuda, "triton", 1, enforce_eager=True)


def _decode_metadata(tables: list[list[int]], computed: list[int]) -> AttentionMetadata:
    return AttentionMetadata.build(block_tables=tables, num_computed_tokens=computed,
                                   query_lens=[1] * len(tables), block_size=4,
                                   num_cache_blocks=32)


def test_static_inputs_take_the_step_and_pad_the_bucket() -> None:
    inputs = StaticDecodeInputs.allocate(max_batch=8, max_blocks=6, device=torch.device("cpu"))
    md = _decode_metadata([[3, 5], [7], [9, 10, 11]], [5, 2, 8])
    ids, positions = torch.tensor([11, 12, 13]), torch.tensor([5, 2, 8])
    inputs.fill(ids, positions, md, size=4)
    assert inputs.tokens[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [5, 2, 8, 0]
    # slot = block * 4 + position % 4; the padded row writes nothing (-1)
    assert inputs.slot_mapping[:4].tolist() == [5 * 4 + 1, 7 * 4 + 2, 11 * 4 + 0, -1]
    assert inputs.seq_lens[:4].tolist() == [6, 3, 9, 1]
    assert inputs.block_tables[:3, :3].tolist() == [[3, 5, 0], [7, 0, 0], [9, 10, 11]]

    # A smaller step next: rows the last step used are padding again, never stale slots.
    md = _decode_metadata([[2]], [0])
    inputs.fill(torch.tensor([21]), torch.tensor([0]), md, size=4)
    assert inputs.slot_mapping[:4].tolist() == [8, -1, -1, -1]
    assert inputs.seq_lens[:4].tolist() == [1, 1, 1, 1]
    assert inputs.tokens[:4].tolist() == [21, 0, 0, 0]


def test_replayed_attention_inputs_give_the_eager_bits() -> None:
    """What a graph's attention reads: the static metadata and tile plan (padded bucket, split
    over the model's whole length), here run without a graph in Triton's interpreter. The real
    rows equal the eager step's bit for bit and the padded rows write no K/V."""
    import pytest

    from kvmemo.engine.cuda_graphs import DecodeGraphs
    from kvmemo.triton_support import triton_unavailable_reason
    from tests.attention.test_triton_kernels import DEVICE, build_step, clone_cache

    reason = triton_unavailable_reason(DEVICE)
    if reason is not None:
        pytest.skip(f"Triton kernels cannot run: {reason}")
    from kvmemo.attention.triton_backend import TritonAttentionBackend

    cache, md, q, k, v = build_step(cached=[40, 300], new=[1, 1], group=3, block_size=16,
                                    head_dim=64, seed=7)
    graph_cache = clone_cache(cache)
    eager = TritonAttentionBackend(0.125).forward(0, q, k, v, cache, md)

    backend = TritonAttentionBackend(0.125)
    graphs = DecodeGraphs(None, graph_cache, backend, max_model_len=1024, max_num_seqs=4,
                          num_heads=q.shape[1])
    assert graphs.sizes == (1, 2, 4)
    ids = torch.tensor([5, 6], device=DEVICE)
    graphs.inputs.fill(ids, ids, md, size=4)
    static_md, plan = graphs._static_metadata(4)
    assert plan.num_segments == 4  # 1,024 positions in segments of 256, whatever the lengths
    backend.use_static_plan(static_md, plan, split=True)
    pad = torch.zeros(2, *q.shape[1:], device=DEVICE)
    kv_pad = torch.zeros(2, *k.shape[1:], device=DEVICE)
    replayed = backend.forward(0, torch.cat([q, pad]), torch.cat([k, kv_pad]),
                               torch.cat([v, kv_pad]), graph_cache, static_md)
    assert torch.equal(replayed[:2], eager)
    assert torch.equal(graph_cache.k_pages[0], cache.k_pages[0])  # padding wrote nothing
    assert torch.equal(graph_cache.v_pages[0], cache.v_pages[0])


def test_importing_the_engine_does_not_import_triton() -> None:
    """triton takes a quarter to half a second to import: only a runner that uses its kernels
    (CUDA, or the interpreter) may pay for it, not every CPU start."""
    import subprocess
    import sys

    code = "import sys, kvmemo.engine, kvmemo.llm; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
