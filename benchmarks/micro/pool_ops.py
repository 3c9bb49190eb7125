"""Block pool operations per second under each eviction policy, at a million blocks.

Each simulated request hits a shared 4-block prefix (touch), takes 16 new blocks (evicting once
the pool is full), commits them under fresh hashes and frees all 20 tail-first, as the KV
manager drives the pool. One operation = one block through take, commit and free. The pool is
filled first, so every measured request evicts.

    python -m benchmarks.micro.pool_ops [--blocks 1000000] [--requests 20000] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from kvmemo.kv.block_pool import BlockPool
from kvmemo.kv.eviction import EVICTION_POLICIES
from kvmemo.kv.hashing import BlockHash

ROOT = BlockHash(b"root")
PREFIX, NEW = 4, 16


def run(policy: str, num_blocks: int, num_requests: int) -> dict[str, float | str]:
    pool = BlockPool(num_blocks, eviction_policy=policy)
    serial = 0

    def request(shared: list) -> None:
        nonlocal serial
        pool.touch(shared)
        blocks = pool.get_new_blocks(NEW)
        parent = shared[-1].block_hash if shared else ROOT
        for block in blocks:
            serial += 1
            own = BlockHash(serial.to_bytes(8, "little"))
            pool.commit_block(block, own, parent, (), ())
            parent = own
        pool.free_blocks(reversed(shared + blocks))

    first = pool.get_new_blocks(PREFIX)
    for i, block in enumerate(first):
        pool.commit_block(block, BlockHash(b"p%d" % i), ROOT if i == 0 else first[i - 1].block_hash,
                          (), ())
    pool.free_blocks(reversed(first))
    shared = [pool.get_cached_block(block.block_hash) for block in first]  # type: ignore[arg-type]
    for _ in range(num_blocks // NEW + 1):  # fill the pool: from here on every request evicts
        request([b for b in shared if b is not None])
    start = time.perf_counter()
    for _ in range(num_requests):
        request([b for b in shared if b is not None])
    seconds = time.perf_counter() - start
    return {"policy": policy, "blocks": num_blocks, "requests": num_requests,
            "block_ops_per_s": round(num_requests * (PREFIX + NEW) / seconds),
            "evicted": pool.num_evicted_blocks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [run(policy, args.blocks, args.requests) for policy in EVICTION_POLICIES]
    if args.json:
        print(json.dumps({"cpu": platform.processor() or platform.machine(), "rows": rows}))
    else:
        for row in rows:
            print(f"{row['policy']:>9}: {row['block_ops_per_s']:>10,} block ops/s "
                  f"({row['blocks']:,} blocks, {row['evicted']:,} evicted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
