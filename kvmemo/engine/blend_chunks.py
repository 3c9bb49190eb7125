"""A blend's chunk sequences in the scheduler's step: their cached blocks held while the blended
prompt is scheduled, and where each chunk's KV goes in it (the runner's BlendStep).

Chunk KV blending: docs/blending.md; the scheduler (scheduler.py) calls these.
"""

from __future__ import annotations

from kvmemo.engine.scheduler_output import BlendStep, ChunkSource
from kvmemo.kv.hybrid import AnyKVCacheManager
from kvmemo.request import Request


def hold_chunks(kv: AnyKVCacheManager, request: Request) -> list[Request]:
    """Takes a reference on each chunk sequence's cached blocks (a partial tail block is
    copied, as for any partial hit); returns the chunk sequences now holding blocks."""
    assert request.blend is not None
    held: list[Request] = []
    for chunk in dict.fromkeys(request.blend.chunk_requests):  # a chunk used twice: once
        chunk.num_computed_tokens = 0
        prefix = kv.get_computed_blocks(chunk)
        if prefix.num_tokens <= request.blend.context_len:
            continue  # evicted since it was computed: its tokens are recomputed instead
        if kv.allocate_slots(chunk, 0, prefix) is None:
            continue
        chunk.num_computed_tokens = prefix.num_tokens
        held.append(chunk)
    return held


def release_chunks(kv: AnyKVCacheManager, chunks: list[Request]) -> None:
    """Frees the chunk sequences' blocks once their blend's prompt has its own."""
    for chunk in chunks:
        kv.free(chunk)
        chunk.num_computed_tokens = 0


def blend_step(kv: AnyKVCacheManager, request: Request, num_cached: int) -> BlendStep:
    """Where each chunk's held KV goes in `request`, past its own cached prefix."""
    spec = request.blend
    assert spec is not None
    sources: list[ChunkSource] = []
    context_len = spec.context_len
    for (start, end), chunk in zip(spec.chunk_ranges, spec.chunk_requests):
        # Held tokens past the context are the chunk's own (0 if it holds nothing).
        available = min(max(chunk.num_computed_tokens - context_len, 0), end - start)
        skip = max(0, num_cached - start)  # already in the prompt's own cached blocks
        if available > skip:
            sources.append(
                ChunkSource(
                    dst_start=start + skip,
                    src_start=context_len + skip,
                    num_tokens=available - skip,
                    src_block_table=kv.get_block_table(chunk.request_id),
                )
            )
    return BlendStep(tuple(sources), spec.recompute_ratio, spec.check_layer)
