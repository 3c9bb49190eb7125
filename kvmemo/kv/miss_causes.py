"""Why a prompt's tokens were computed instead of read from the cache: every uncached prompt token
of a request gets exactly one cause, so the causes add up to the uncached tokens.

Causes, tested per full block from the first uncached one on (tokens a partial hit already
served are not counted):
- cache_skipped: the request reads no cached KV (it asked for prompt logprobs), or caching is off;
- last_token: the prompt's last token when every token before it was read from the cache: the
  step needs its logits, so it is always computed;
- evicted: the block was cached and evicted to make room (the report names the policy), or it is
  still cached but unreachable because a block before it in its chain (or one of another layer
  group) was evicted;
- expired_retention: evicted after its retention (cache_control ttl) had run out;
- template_drift: the block where the prompt leaves a cached chain at a token the engine
  generated (or the one just before it, which a tokenizer may merge with the reply's first
  word): the conversation's history re-renders an earlier reply in other tokens than it was
  generated as (a template that drops reasoning or reformats tool calls); `diverged_at` is the
  first token that differs;
- diverged: the same, at a prompt token (an edited system prompt or history);
- other_salt: the same tokens, after the same tokens, are or were cached under another cache_salt
  (the server's counters only: a request's own answer says never_seen, see for_the_client);
- never_seen: none of the above (within the ledger's memory, miss_ledger.py);
- partial_tail: the prompt's last, partially filled block's tokens that no cached block covered
  (the cache keeps full blocks; a partial match copies what it can).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmemo.kv.miss_ledger import MissReport, chain_keys

if TYPE_CHECKING:
    from kvmemo.kv.hybrid import AnyKVCacheManager
    from kvmemo.kv.manager import KVCacheManager
    from kvmemo.request import Request

_MAX_SIBLINGS = 64  # cached blocks compared when looking for where a prompt diverged


def explain_misses(kv: AnyKVCacheManager, request: Request, num_cached: int) -> MissReport:
    """The causes of the request's `num_prompt_tokens - num_cached` uncached prompt tokens, at
    its first schedule (before its own blocks are committed); also added to the ledger's totals.
    Reads the full-attention group (group 0)."""
    manager: KVCacheManager = getattr(kv, "groups", [kv])[0]
    pool, size = manager.block_pool, manager.block_size
    num_prompt = request.num_prompt_tokens
    tokens: dict[str, int] = {}

    def add(cause: str, count: int) -> None:
        if count > 0:
            tokens[cause] = tokens.get(cause, 0) + count

    diverged_at = None
    if not manager.enable_caching or request.skips_prefix_cache:
        add("cache_skipped", num_prompt - num_cached)
    elif num_cached == num_prompt - 1:
        add("last_token", 1)
    else:
        num_full = num_prompt // size
        first = num_cached // size
        keys = chain_keys(request.prompt_token_ids, size, num_full, request.token_keys)
        cause = ""
        for index in range(first, num_full):
            start, end = max(index * size, num_cached), (index + 1) * size
            block_hash = request.block_hashes[index]
            if pool.get_cached_block(block_hash, manager.group) is not None:
                cause = cause or "evicted"  # unreachable: a block before it went
            elif (left := pool.misses.how_it_left(block_hash)) is not None:
                cause = left
            elif index == first and (found := _divergence(manager, request, index)):
                diverged_at, drift = found
                cause = "template_drift" if drift else "diverged"
            elif pool.misses.stored_by_another(keys[index], request.cache_salt):
                cause = "other_salt"
            else:
                cause = "never_seen"
            add(cause, end - start)
        tail = num_prompt - max(num_full * size, num_cached)
        found = _divergence(manager, request, num_full) if tail and first == num_full else None
        if found:  # the prompt leaves a cached chain in its last, partial block
            diverged_at = found[0]
        add("template_drift" if found and found[1] else "partial_tail", tail)
    report = MissReport(tokens, diverged_at, pool.eviction_policy)
    pool.misses.record(report)
    return report


def _divergence(manager: KVCacheManager, request: Request, index: int) -> tuple[int, bool] | None:
    """(the first token where block `index` differs from the closest cached block chained from
    the same parent with the same extra keys, whether that block's differing token was
    generated), if such a block is cached and the prompt matched anything before; else None.
    The same extra keys mean the same cache_salt: another tenant's tokens are never compared."""
    size = manager.block_size
    parent, keys = manager.parent_hash(request, index), manager.extra_keys(request, index)
    own = request.prompt_token_ids[index * size : (index + 1) * size]
    best, drift = -1, False
    siblings = manager.block_pool.get_cached_children(parent, manager.group)
    for count, sibling in enumerate(siblings):
        if count == _MAX_SIBLINGS:
            break
        if sibling.extra_keys != keys:
            continue
        same = 0
        for a, b in zip(own, sibling.token_ids or ()):
            if a != b:
                break
            same += 1
        if same > best:
            assert sibling.block_hash is not None
            generated = manager.block_pool.misses.generated_from(sibling.block_hash)
            # A reply re-rendered as other text may also change the token before it, where a
            # tokenizer merges the template's separator with the reply's first word.
            best, drift = same, generated is not None and generated - 1 <= same
    position = index * size + best
    return (position, drift) if best >= 0 and position > 0 else None
