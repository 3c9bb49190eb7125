"""Paged attention vs dense SDPA over a contiguous cache of the same shapes (one layer call).

    python -m benchmarks.micro.bench_attention [--threads 1] [--repeats 30] [--profile]

decode: 32 sequences x 1,024 context tokens, one new token each; prefill: 4 sequences x 128 new
tokens over a 896-token cached prefix. SmolLM2 shapes: 9 q heads, 3 kv heads, head_dim 64, block
16, fp32 compute. Block tables are a random permutation of the pool (the worst case: no two
consecutive pages adjacent). Paged = PagedAttentionBackend.forward, i.e. the K/V write plus
attention, with the step's plan built once as in the engine (decode: the compiled CPU kernel;
paged_fp32_gather: the torch fallback), in the faster mode (batch_invariant=False: flash prefill,
keys split over threads); paged_fp32_invariant: the engine's default, every query row alone
through the decode kernel (attention/invariant.py); dense = F.scaled_dot_product_attention alone. Timings are interleaved A/B/... in one process; medians reported. Writes
benchmarks/results/attention.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.machine_info import cpu_label
from benchmarks.paths import RESULTS as RESULTS_DIR
from kvmemo.attention import paged
from kvmemo.attention.backend import PagedAttentionBackend
from kvmemo.attention.cache import PagedKVCache
from kvmemo.attention.metadata import AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5
RESULTS = RESULTS_DIR / "attention.json"


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median and min ms of each function, run round-robin so load changes hit all alike."""
    for fn in fns.values():  # warm up: buffers, allocator, kernels
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    median = {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}
    return median, {name: round(min(t) * 1e3, 3) for name, t in times.items()}


def paged_case(
    num_seqs: int, cached: int, new: int, kv_dtype: torch.dtype, seed: int = 0,
    invariant: bool = False,
) -> tuple[PagedAttentionBackend, PagedKVCache, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool whose pages hold `cached` random tokens per sequence, block tables shuffled; the
    backend in the faster (variant) mode unless `invariant` (the engine's default)."""
    torch.manual_seed(seed)
    blocks_per_seq = -(-(cached + new) // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq + 8
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                  num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=kv_dtype, device="cpu")
    if cache.is_fp8:
        cache.set_scales(torch.full((1, NUM_KV_HEADS), 2.0**-6), torch.full((1, NUM_KV_HEADS), 2.0**-6))
    order = torch.randperm(num_blocks)[: num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq)
    tables = order.tolist()
    prefix = AttentionMetadata.build(block_tables=tables, num_computed_tokens=[0] * num_seqs,
                                     query_lens=[cached] * num_seqs, block_size=BLOCK_SIZE,
                                     num_cache_blocks=num_blocks)
    cache.write(0, torch.randn(num_seqs * cached, NUM_KV_HEADS, HEAD_DIM),
                torch.randn(num_seqs * cached, NUM_KV_HEADS, HEAD_DIM), prefix.slot_mapping)
    metadata = AttentionMetadata.build(block_tables=tables, num_computed_tokens=[cached] * num_seqs,
                                       query_lens=[new] * num_seqs, block_size=BLOCK_SIZE,
                                       num_cache_blocks=num_blocks)
    num_tokens = num_seqs * new
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    return PagedAttentionBackend(SCALE, batch_invariant=invariant), cache, metadata, q, k, v


def decode_bench(num_seqs: int, context: int, repeats: int) -> dict:
    group = NUM_HEADS // NUM_KV_HEADS
    q_dense = torch.randn(num_seqs, NUM_HEADS, 1, HEAD_DIM)
    k_dense = torch.randn(num_seqs, NUM_KV_HEADS, context, HEAD_DIM)
    v_dense = torch.randn(num_seqs, NUM_KV_HEADS, context, HEAD_DIM)
    fns: dict[str, Callable[[], object]] = {
        "dense_sdpa_gqa": lambda: F.scaled_dot_product_attention(q_dense, k_dense, v_dense, enable_gqa=True),
        "dense_sdpa_folded": lambda: F.scaled_dot_product_attention(
            q_dense.view(num_seqs, NUM_KV_HEADS, group, HEAD_DIM), k_dense, v_dense),
    }
    for name, dtype in (("paged_fp32", torch.float32), ("paged_bf16_kv", torch.bfloat16),
                        ("paged_fp8_kv", torch.float8_e4m3fn)):
        backend, cache, md, q, k, v = paged_case(num_seqs, context - 1, 1, dtype)
        fns[name] = (lambda b=backend, c=cache, m=md, q=q, k=k, v=v: b.forward(0, q, k, v, c, m))
    backend, cache, md, q, k, v = paged_case(num_seqs, context - 1, 1, torch.float32, invariant=True)
    fns["paged_fp32_invariant"] = lambda: backend.forward(0, q, k, v, cache, md)
    backend, cache, md, q, k, v = paged_case(num_seqs, context - 1, 1, torch.float32)
    fns["paged_fp32_gather"] = without_kernel(lambda: backend.forward(0, q, k, v, cache, md))
    fns["previous_token_major"] = previous_decode(num_seqs, context)
    ms, min_ms = interleaved(fns, repeats)

    def ratio(t: dict[str, float]) -> float:
        dense = ("dense_sdpa_gqa", "dense_sdpa_folded")
        return round(t["paged_fp32"] / min(t[name] for name in dense), 3)

    return {"shape": f"{num_seqs} seqs x {context} ctx, Hq={NUM_HEADS}, Hkv={NUM_KV_HEADS}, D={HEAD_DIM}",
            "ms": ms, "min_ms": min_ms, "paged_over_best_dense": ratio(ms),
            "paged_over_best_dense_min": ratio(min_ms)}


def without_kernel(fn: Callable[[], object]) -> Callable[[], object]:
    """fn run on the torch fallback (gather + SDPA), as on a machine without a C compiler."""

    def run() -> object:
        saved = paged.load_decode_kernel
        paged.load_decode_kernel = lambda: None
        try:
            return fn()
        finally:
            paged.load_decode_kernel = saved

    return run


def previous_decode(num_seqs: int, context: int) -> Callable[[], object]:
    """The pre-issue-4 decode path, for the record: token-major pages, a fresh gather per call."""
    nb = context // BLOCK_SIZE
    pool = torch.randn(num_seqs * nb + 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    tables = torch.randperm(pool.shape[0])[: num_seqs * nb].view(num_seqs, nb)
    q = torch.randn(num_seqs, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)
    mask = torch.ones(num_seqs, 1, 1, context, dtype=torch.bool)

    def run():
        k = pool[tables].view(num_seqs, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = pool[tables].view(num_seqs, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return run


def prefill_bench(num_seqs: int, cached: int, new: int, repeats: int) -> dict:
    context = cached + new
    q_dense = torch.randn(num_seqs, NUM_HEADS, new, HEAD_DIM)
    k_dense = torch.randn(num_seqs, NUM_KV_HEADS, context, HEAD_DIM)
    v_dense = torch.randn(num_seqs, NUM_KV_HEADS, context, HEAD_DIM)
    mask = torch.arange(context)[None, :] <= torch.arange(cached, context)[:, None]  # [new, context]
    fns: dict[str, Callable[[], object]] = {
        "dense_sdpa_gqa": lambda: F.scaled_dot_product_attention(
            q_dense, k_dense, v_dense, attn_mask=mask, enable_gqa=True),
    }
    for name, dtype in (("paged_fp32", torch.float32), ("paged_fp8_kv", torch.float8_e4m3fn)):
        backend, cache, md, q, k, v = paged_case(num_seqs, cached, new, dtype)
        fns[name] = (lambda b=backend, c=cache, m=md, q=q, k=k, v=v: b.forward(0, q, k, v, c, m))
    backend, cache, md, q, k, v = paged_case(num_seqs, cached, new, torch.float32, invariant=True)
    fns["paged_fp32_invariant"] = lambda: backend.forward(0, q, k, v, cache, md)
    ms, min_ms = interleaved(fns, repeats)
    return {"shape": f"{num_seqs} seqs x ({cached} cached + {new} new), Hq={NUM_HEADS}, Hkv={NUM_KV_HEADS}, D={HEAD_DIM}",
            "ms": ms, "min_ms": min_ms, "paged_over_dense": round(ms["paged_fp32"] / ms["dense_sdpa_gqa"], 3),
            "paged_over_dense_min": round(min_ms["paged_fp32"] / min_ms["dense_sdpa_gqa"], 3)}


def profile_decode(num_seqs: int, context: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    backend, cache, md, q, k, v = paged_case(num_seqs, context - 1, 1, torch.float32)
    backend.forward(0, q, k, v, cache, md)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            backend.forward(0, q, k, v, cache, md)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of decode")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        profile_decode(32, 1024)
        return 0
    result = {
        "machine": {"cpu": cpu_label(), "torch": torch.__version__,
                    "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "decode": decode_bench(32, 1024, args.repeats),
        "prefill": prefill_bench(4, 896, 128, args.repeats),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
