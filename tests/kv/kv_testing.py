"""Helpers for the kv tests: a hasher, a manager and requests with small, readable sizes."""

from __future__ import annotations

from kvmemo.kv.hashing import RequestHasher, namespace_root_hash
from kvmemo.kv.layout import KVLayout, full_attention_groups
from kvmemo.kv.manager import KVCacheManager, PrefixMatch
from kvmemo.kv.mm_items import MultiModalItem
from kvmemo.request import Request
from kvmemo.sampling import SamplingParams


def make_layout(
    num_blocks: int = 10, block_size: int = 4, algorithm: str = "sha256"
) -> KVLayout:
    root = namespace_root_hash(
        weights_fingerprint="test-weights",
        kv_cache_dtype="bfloat16",
        block_size=block_size,
        algorithm=algorithm,
    )
    return KVLayout(
        block_size=block_size,
        num_blocks=num_blocks,
        kv_cache_dtype="bfloat16",
        bytes_per_token=4,
        namespace_root=root,
        hash_algorithm=algorithm,
        groups=full_attention_groups(2),
    )


def make_hasher(block_size: int = 4, algorithm: str = "sha256") -> RequestHasher:
    return make_layout(block_size=block_size, algorithm=algorithm).new_hasher()


def make_manager(
    num_blocks: int = 10, block_size: int = 4, eviction_policy: str = "lru", **kwargs: bool
) -> KVCacheManager:
    """A manager over a small pool; LRU unless asked (the story tests spell out LRU's order)."""
    return KVCacheManager(
        make_layout(num_blocks, block_size), eviction_policy=eviction_policy, **kwargs
    )


def make_request(
    request_id: str,
    token_ids: list[int],
    *,
    mm_items: list[MultiModalItem] | None = None,
    cache_salt: str | None = None,
    hasher: RequestHasher | None = None,
    block_size: int = 4,
) -> Request:
    """A request hashed like the engine's (the test layout's hasher unless one is given)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(),
        mm_items=mm_items or [],
        cache_salt=cache_salt,
        hasher=hasher if hasher is not None else make_hasher(block_size),
    )


def admit(
    manager: KVCacheManager, request: Request, num_new_tokens: int | None = None
) -> tuple[PrefixMatch, list[int] | None]:
    """Scheduler-style first allocation: match, allocate (all remaining tokens by default)."""
    prefix = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - prefix.num_tokens
    new_block_ids = manager.allocate_slots(request, num_new_tokens, prefix)
    if new_block_ids is not None:
        request.num_computed_tokens = prefix.num_tokens
    manager.check_invariants()
    return prefix, new_block_ids


def finish_step(manager: KVCacheManager, request: Request, num_tokens: int | None = None) -> None:
    """The step computed `num_tokens` more tokens (default: all the rest): advance and commit."""
    if num_tokens is None:
        num_tokens = request.num_tokens - request.num_computed_tokens
    request.num_computed_tokens += num_tokens
    manager.commit(request, request.num_computed_tokens)
    manager.check_invariants()


def ref_counts(manager: KVCacheManager) -> dict[int, int]:
    """ref_count of every held block."""
    return {b.block_id: b.ref_count for b in manager.block_pool.blocks if b.ref_count}


def hit_ids(prefix: PrefixMatch) -> list[int]:
    return [block.block_id for block in prefix.blocks]
