"""Disk KV store benchmark: TTFT of a ~1,000-token prefix from the device cache, from disk
(a fresh engine on the same store) and recomputed; store read GB/s against dd on the same files.

    python -m benchmarks.micro.bench_disk_store [--device cpu|cuda] [--num-words 700] [--store DIR]

Prints one table. Page cache: every read here is warm (the files were just written), for kvmemo
and dd alike, so the GB/s compare the read + validation paths, not the disk.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvmemo import LLM, SamplingParams
from tests.connector.store_worker import long_prompt


def ttft(llm: LLM, prompt: str) -> tuple[float, int]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.engine.flush_kv_store()
    return out.metrics.first_token_time - out.metrics.arrival_time, out.metrics.num_cached_tokens


def med(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-words", type=int, default=700)
    parser.add_argument("--store", default=None, help="store directory (default: a new temp dir)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    store_dir = Path(args.store or tempfile.mkdtemp(prefix="kvmemo-store-"))
    options = {"num_blocks": 512, "device": args.device, "kv_store": f"disk:{store_dir}"}
    prompt = long_prompt(args.num_words)

    first = LLM(**options)
    num_tokens = len(first.engine.processor.encode_prompt(prompt))
    cold_save_s, _ = ttft(first, prompt)  # recompute + copy-off-device of every block
    device_s = []
    for _ in range(args.repeats):
        t, cached = ttft(first, prompt)
        device_s.append(t)
    del first

    second = LLM(**options)  # a fresh engine: an empty device cache, the same store
    disk_s, disk_cached = ttft(second, prompt)
    more_disk = []
    recompute_s = []
    engine = second.engine
    for _ in range(args.repeats - 1):
        assert second.reset_prefix_cache()[0]
        t, _ = ttft(second, prompt)
        more_disk.append(t)
    connector = engine.kv_connector
    load_s = connector.stats.load_s
    engine.scheduler.connector = None  # the same engine, store off: plain recompute
    engine.kv_connector = None
    for _ in range(args.repeats):
        assert second.reset_prefix_cache()[0]
        t, cached = ttft(second, prompt)
        assert cached == 0
        recompute_s.append(t)

    # Store read throughput: every block of the namespace, read + validated by DiskStore.get.
    store = connector.store
    files = sorted(store.dir.rglob("*.kvb"))
    total_bytes = sum(f.stat().st_size for f in files)
    hashes = [bytes.fromhex(f.name[:-4]) for f in files]
    start = time.perf_counter()
    for h in hashes:
        assert store.get(h) is not None
    get_s = time.perf_counter() - start
    start = time.perf_counter()
    for f in files:
        f.read_bytes()
    raw_s = time.perf_counter() - start
    script = (
        "for f in "
        + " ".join(f"'{f}'" for f in files)
        + '; do dd if="$f" of=/dev/null bs=1M status=none; done'
    )
    start = time.perf_counter()
    subprocess.run(["bash", "-c", script], check=True)
    dd_s = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(
        [
            "bash",
            "-c",
            "cat " + " ".join(f"'{f}'" for f in files) + " | dd of=/dev/null bs=1M status=none",
        ],
        check=True,
    )
    dd_one_s = time.perf_counter() - start

    gb = total_bytes / 1e9
    print(
        f"prompt: {num_tokens} tokens, {len(files)} blocks on disk, {total_bytes / 2**20:.1f} MiB, device {args.device}"
    )
    print(f"TTFT device cache : {med(device_s) * 1000:8.1f} ms (median of {len(device_s)})")
    print(
        f"TTFT from disk    : {disk_s * 1000:8.1f} ms (first, fresh engine; {disk_cached} tokens loaded)"
        + (f", {med(more_disk) * 1000:.1f} ms median of later reloads" if more_disk else "")
    )
    print(
        f"TTFT recompute    : {med(recompute_s) * 1000:8.1f} ms (median of {len(recompute_s)}); "
        f"cold with saving {cold_save_s * 1000:.1f} ms"
    )
    print(f"store get (read+sha256+checks): {gb / get_s:6.2f} GB/s")
    print(f"python read_bytes only        : {gb / raw_s:6.2f} GB/s")
    print(f"dd per file (one dd each)      : {gb / dd_s:6.2f} GB/s")
    print(f"cat | dd (one stream)          : {gb / dd_one_s:6.2f} GB/s")
    print(
        f"store_load_s per reload (read + validate + copy in): {load_s / args.repeats * 1000:.1f} ms"
    )
    if args.store is None:
        shutil.rmtree(store_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
