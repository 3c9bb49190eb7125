"""The GPU figures of issue 43, in one process on a lent GPU (run by scripts/gpu_check.sh).

    python -m benchmarks.gpu.bench_gpu --out results.json [--parts attention,decode,w1,ttft]

attention: paged decode attention (Triton kernels, the K/V write included and not) against
    F.scaled_dot_product_attention over a contiguous cache of the same shapes, bf16.
decode: one engine decode step at batch 1 and 32 (SmolLM2, bf16), with CUDA graphs, eager, and
    with graphs on cuBLAS GEMMs; and the launch floor: a CUDA graph replay of the same model
    forward with attention replaced by the identity.
w1: W1 (32 requests sharing a ~1,024-token system prompt, 32 tokens each) through kvmemo and
    through HF transformers `generate` (batched, static cache) on the same GPU, bf16.
ttft: time to first token of an 8,000-token prompt, cold and then cached.
Each part records its error instead of stopping the others; the JSON names the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F


def timed_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median wall ms of fn, the GPU synchronised around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_attention() -> dict[str, Any]:
    from kvmemo.attention.cache import PagedKVCache
    from kvmemo.attention.kernels.triton_attention import TilePlan, paged_attention
    from kvmemo.attention.metadata import AttentionMetadata
    from kvmemo.attention.triton_backend import TritonAttentionBackend

    out: dict[str, Any] = {}
    shapes = [("smollm2", 9, 3, 64), ("llama8b", 32, 8, 128)]
    for name, hq, hkv, d in shapes:
        for batch, context in ((1, 8192), (32, 4096)):
            block = 16
            num_blocks = batch * context // block + 1
            cache = PagedKVCache.allocate(num_layers=1, num_blocks=num_blocks, block_size=block,
                                          num_kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                                          device="cuda")
            cache.k_pages[0].normal_()
            cache.v_pages[0].normal_()
            perm = torch.randperm(num_blocks - 1).tolist()
            per = context // block
            tables = [perm[i * per:(i + 1) * per] for i in range(batch)]
            md = AttentionMetadata.build(block_tables=tables, num_computed_tokens=[context - 1] * batch,
                                         query_lens=[1] * batch, block_size=block,
                                         num_cache_blocks=num_blocks, device="cuda")
            q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(batch, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(batch, hkv, d, device="cuda", dtype=torch.bfloat16)
            scale = d**-0.5
            plan = TilePlan.build(md.query_lens, md.seq_lens, hq // hkv, torch.device("cuda"))
            k_dense = torch.randn(batch, hkv, context, d, device="cuda", dtype=torch.bfloat16)
            v_dense = torch.randn_like(k_dense)
            q_dense = q[:, :, None, :]
            row: dict[str, Any] = {}
            for split in (False, True):
                row[f"paged_kernel_split={split}_ms"] = timed_ms(lambda: paged_attention(
                    q, cache.k_pages[0], cache.v_pages[0], md.block_tables, plan, scale,
                    split=split), repeats=50)
            backend = TritonAttentionBackend(scale)
            row["paged_backend_with_write_ms"] = timed_ms(
                lambda: backend.forward(0, q, k, v, cache, md), repeats=50)
            row["sdpa_contiguous_ms"] = timed_ms(lambda: F.scaled_dot_product_attention(
                q_dense, k_dense, v_dense, scale=scale, enable_gqa=True), repeats=50)
            best = min(row[f"paged_kernel_split={s}_ms"] for s in (False, True))
            row["paged_over_sdpa"] = best / row["sdpa_contiguous_ms"]
            out[f"{name}_b{batch}_ctx{context}"] = row
    return out


def _engine(**kwargs: Any):
    from kvmemo import LLM

    return LLM(device="cuda", dtype="bfloat16", weights="dense", **kwargs)


def bench_decode() -> dict[str, Any]:
    """Decode steps with graphs (the default), eager, and with graphs on cuBLAS's GEMMs instead
    of the batch-invariant Triton ones (what invariance costs); each against the launch floor
    of its own kernels."""
    import os

    out: dict[str, Any] = {}
    modes = (("graphs", False, None), ("eager", True, None), ("graphs_cublas", False, "torch"))
    for mode, eager, linear_kernel in modes:
        if linear_kernel:
            os.environ["KVMEMO_LINEAR_KERNEL"] = linear_kernel
        try:
            llm = _engine(num_blocks=4096, enforce_eager=eager)
        finally:
            os.environ.pop("KVMEMO_LINEAR_KERNEL", None)
        out[f"{mode}_attention_backend"] = llm.engine.runner.attention_backend.name
        out[f"{mode}_linear_kernel"] = llm.engine.runner.model.linear_choice.decode
        for batch in (1, 32):
            out[f"decode_step_{mode}_b{batch}_ms"] = _decode_step_ms(llm, batch)
        if mode != "graphs_cublas":
            out[f"{mode}_b1_profile"] = _profile_steps(llm, 1)
        if mode != "graphs":  # eager holds the same kernels as graphs
            floor = "launch_floor" if mode == "eager" else "launch_floor_cublas"
            for batch in (1, 32):
                out[f"{floor}_b{batch}_ms"] = _graph_floor(llm, batch)
        del llm
    for batch in (1, 32):
        out[f"graphs_over_floor_b{batch}"] = (
            out[f"decode_step_graphs_b{batch}_ms"] / out[f"launch_floor_b{batch}_ms"])
        out[f"graphs_cublas_over_floor_b{batch}"] = (
            out[f"decode_step_graphs_cublas_b{batch}_ms"]
            / out[f"launch_floor_cublas_b{batch}_ms"])
    return out


def _start_decodes(llm: Any, batch: int, max_tokens: int = 200) -> Any:
    from kvmemo import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [(i * 131 + j * 7) % 40000 + 100 for j in range(128)]
        engine.add_request(f"d{batch}-{i}-{time.monotonic_ns()}",
                           engine.processor.process(prompt), params)
    for _ in range(3):  # prefill, then decode steps that capture or compile
        engine.step()
    return engine


def _decode_step_ms(llm: Any, batch: int) -> float:
    engine = _start_decodes(llm, batch)
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def _profile_steps(llm: Any, batch: int) -> str:
    """cProfile of 20 decode steps: where the host time goes (top 30 by own time)."""
    import cProfile
    import io
    import pstats

    engine = _start_decodes(llm, batch)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    while engine.has_unfinished_requests():
        engine.step()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()[-6000:]


def _graph_floor(llm: Any, batch: int) -> float:
    """One CUDA graph replay of the model's forward for `batch` tokens with attention replaced
    by the identity, plus the head: the launch-bound floor of a decode step."""
    model = llm.engine.runner.model
    tokens = torch.full((batch,), 100, device="cuda", dtype=torch.long)
    positions = torch.full((batch,), 200, device="cuda", dtype=torch.long)

    def forward() -> torch.Tensor:
        hidden = model(tokens, positions, lambda layer, q, k, v: q)
        return model.compute_logits(hidden)

    with torch.inference_mode():
        forward()  # rope tables and anything lazy, outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        return timed_ms(graph.replay, repeats=50)


def bench_w1() -> dict[str, Any]:
    from benchmarks.workloads import build_w1, bundled_tokenizer
    from kvmemo import SamplingParams

    workload = build_w1(bundled_tokenizer())
    prompts = [r["prompt_token_ids"] for r in workload.requests]
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True)
    llm = _engine(num_blocks=8192)
    llm.generate([[5, 6, 7] * 40], params, use_tqdm=False)  # compile the kernels first
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    out: dict[str, Any] = {"kvmemo_s": time.perf_counter() - start,
                           "requests": len(prompts), "output_tokens": workload.max_tokens}
    del llm
    out.update(_hf_w1(prompts, workload.max_tokens))
    out["kvmemo_speedup_over_hf"] = out["hf_s"] / out["kvmemo_s"]
    return out


def _hf_w1(prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from kvmemo.model.loading.loader import bundled_model_path

    path = Path(bundled_model_path())
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.bfloat16).to("cuda").eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation wants
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    out: dict[str, Any] = {}
    for cache in ("static", "dynamic"):
        try:
            def run() -> None:
                with torch.inference_mode():
                    hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                                cache_implementation=cache if cache == "static" else None)
            run()  # warm-up (static: allocates and may compile)
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            out[f"hf_{cache}_s"] = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - record and go on to the other cache
            out[f"hf_{cache}_error"] = repr(e)[:300]
    timings = [v for k, v in out.items() if k.endswith("_s")]
    out["hf_s"] = min(timings) if timings else float("nan")
    return out


def bench_ttft() -> dict[str, Any]:
    from kvmemo import SamplingParams

    llm = _engine(num_blocks=4096, max_model_len=8192)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prompt(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(100, 40000, (8000,), generator=g).tolist()

    for _ in range(2):  # warm-up: the cold and the cached step's kernels compiled
        llm.generate([prompt(1)], params, use_tqdm=False)
    out: dict[str, Any] = {"prompt_tokens": 8000}
    for label in ("cold", "cached"):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt(2)], params, use_tqdm=False)
        torch.cuda.synchronize()
        out[f"{label}_ms"] = (time.perf_counter() - start) * 1e3
    out["cached_over_cold"] = out["cached_ms"] / out["cold_ms"]
    return out


PARTS = {"attention": bench_attention, "decode": bench_decode, "w1": bench_w1, "ttft": bench_ttft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default=",".join(PARTS))
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "multiprocessors": props.multi_processor_count,
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    for name in args.parts.split(","):
        start = time.perf_counter()
        try:
            result[name] = PARTS[name]()
        except Exception:  # noqa: BLE001 - one part's failure must not lose the others
            result[name] = {"error": traceback.format_exc()[-2000:]}
        result[name]["part_wall_s"] = round(time.perf_counter() - start, 1)
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps({name: result[name]}, indent=1), flush=True)


if __name__ == "__main__":
    main()
