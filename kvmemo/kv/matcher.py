"""PrefixMatcher: the KV cache manager's read-only half, which cached blocks serve a request.

Full blocks by hash (verified against their stored tokens, parent hash and extra keys: a hash
collision cannot serve wrong KV), then one partial block to copy; blocks other requests compute
in the same step; the exact match of a given length a hybrid layout's groups agree on. Nothing
here changes the pool: the waiting queue may be ordered by repeated matches.
KVCacheManager (manager.py) owns the state these methods read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvmemo.kv.block import Block
from kvmemo.kv.block_pool import BlockPool
from kvmemo.kv.hashing import BlockHash, ExtraKeys, RequestHasher, extra_keys_for_range
from kvmemo.kv.layout import first_window_block
from kvmemo.kv.match import NO_MATCH, PartialMatch, PrefixMatch
from kvmemo.kv.partial_index import PartialIndex, common_prefix_len

if TYPE_CHECKING:
    from kvmemo.request import Request


@dataclass(slots=True, eq=False)
class RequestBlocks:
    request: Request
    # The block_table, append-only while the request runs; None where a sliding-window group
    # released a block its window no longer sees.
    blocks: list[Block | None]
    num_committed_blocks: int  # leading blocks committed (or hit, or stored-once duplicates)


class PrefixMatcher:
    """The matching methods of KVCacheManager, over the state it owns (declared here)."""

    block_size: int
    group: int
    window: int | None
    enable_caching: bool
    enable_partial_reuse: bool
    block_pool: BlockPool
    _hasher: RequestHasher
    _partial: PartialIndex
    _requests: dict[str, RequestBlocks]

    def parent_hash(self, request: Request, index: int) -> BlockHash:
        """The hash block `index` of the request is chained from (the root's for block 0)."""
        return self._hasher.parent_hash(request, index)

    def extra_keys(self, request: Request, index: int) -> ExtraKeys:
        """Block `index`'s extra keys (its cache_salt, images, reuse marker)."""
        return self._hasher.extra_keys(request, index)

    def get_computed_blocks(self, request: Request) -> PrefixMatch:
        """Longest verified cached prefix of `request`: full blocks, then one partial match.

        The partial match serves the first k tokens of the next block from a partially filled
        block or from a committed full block with the same parent (the request diverges from it,
        or stops hitting it because of the last-token rule, mid-block); see _find_partial.

        Does not modify the pool (safe to call repeatedly, e.g. to order the waiting queue).
        At least one token is always left to compute. Reads request.block_hashes, which the
        request extends itself.

        Raises:
            ValueError: if request.num_computed_tokens != 0 (only for a first schedule or after
                preemption).
        """
        if request.num_computed_tokens != 0:
            raise ValueError(
                "get_computed_blocks needs request.num_computed_tokens == 0, "
                f"got {request.num_computed_tokens}"
            )
        if not self.enable_caching or request.skips_prefix_cache:
            return NO_MATCH
        size = self.block_size
        tokens = request.all_token_ids
        max_hit_tokens = len(tokens) - 1  # the step needs logits at the last position
        hits: list[Block] = []
        parent = self._hasher.root
        for index in range(min(len(request.block_hashes), max_hit_tokens // size)):
            block_hash = request.block_hashes[index]
            block = self.block_pool.get_cached_block(block_hash, self.group)
            if block is None or not self._holds(block, parent, request, index):
                break
            hits.append(block)
            parent = block_hash

        start = len(hits) * size
        partial = None
        num_partial_max = min(size - 1, max_hit_tokens - start)
        if self.enable_partial_reuse and num_partial_max > 0:
            partial = self._find_partial(request, parent, len(hits), num_partial_max)
        if not hits and partial is None:
            return NO_MATCH
        num_tokens = start + (partial.num_tokens if partial is not None else 0)
        return PrefixMatch(blocks=tuple(hits), num_tokens=num_tokens, partial=partial)

    def _find_partial(
        self, request: Request, parent: BlockHash, index: int, num_tokens_max: int
    ) -> PartialMatch | None:
        """Best copy source for the first tokens (at most num_tokens_max) of block `index`.

        Candidates chain from `parent`: partially filled blocks (partial index; their extra keys
        over their own token range must equal the request's) and committed full blocks (pool's
        parent index; their extra keys over the whole block must equal the request's over the
        same range). The longest common prefix k > 0 wins; on a tie a referenced block (copying
        from it leaves the free queue alone), then a partially filled one, then the oldest commit.
        Costs O(candidates chained from `parent`).
        """
        start = index * self.block_size
        window = request.all_token_ids[start : start + num_tokens_max]
        best: PartialMatch | None = None
        found = self._partial.find(
            parent, window, lambda num: extra_keys_for_range(request, start, start + num)
        )
        if found is not None:
            best = PartialMatch(block=found[0], num_tokens=found[1])
        full_block_keys = None  # computed once, for the first candidate that needs them
        for block in self.block_pool.get_cached_children(parent, self.group):
            assert block.token_ids is not None and block.parent_hash == parent
            k = common_prefix_len(block.token_ids, window)
            if k == 0 or (
                best is not None
                and (k, block.ref_count > 0) <= (best.num_tokens, best.block.ref_count > 0)
            ):
                continue
            if full_block_keys is None:
                full_block_keys = self._hasher.extra_keys(request, index)
            if block.extra_keys == full_block_keys:
                best = PartialMatch(block=block, num_tokens=k, source_hash=block.block_hash)
        return best

    def extend_in_flight(
        self, request: Request, prefix: PrefixMatch, computing: Mapping[BlockHash, Request]
    ) -> PrefixMatch:
        """`prefix` extended by the full blocks other requests compute in the step being
        scheduled, or `prefix` itself when its next block is not among them.

        `computing` maps the hash of each full block the step completes to the request holding
        it (Scheduler._track_computing). Sharing such a block instead of computing it again is
        safe because the step writes every new token's KV before any layer's attention reads it,
        so a request whose cached prefix ends in blocks written by the same forward sees them
        complete; the owner commits them after the step, as usual. A partial match is dropped
        (its tokens lie in the first shared block). The shared run is verified against the
        owner's tokens and extra keys, like any hit, and keeps the last-token rule.
        """
        if not self.enable_caching or request.skips_prefix_cache:
            return prefix
        size = self.block_size
        first = len(prefix.blocks)
        end = min(len(request.block_hashes), (request.num_tokens - 1) // size)
        owner = computing.get(request.block_hashes[first]) if first < end else None
        owner_state = self._requests.get(owner.request_id) if owner is not None else None
        if owner is None or owner_state is None:
            return prefix
        shared: list[Block] = []
        for index in range(first, min(end, len(owner_state.blocks))):
            block = owner_state.blocks[index]
            if (
                computing.get(request.block_hashes[index]) is not owner
                or block is None
                or block.block_hash is not None
                or self._hasher.extra_keys(owner, index) != self._hasher.extra_keys(request, index)
            ):
                break
            shared.append(block)
        num_tokens = (first + len(shared)) * size
        # Hashes chain over every earlier token, but equal hashes are not proof: compare them all.
        if not shared or owner.all_token_ids[:num_tokens] != request.all_token_ids[:num_tokens]:
            return prefix
        return PrefixMatch(
            blocks=(*prefix.blocks, *shared), num_tokens=num_tokens, num_in_flight=len(shared)
        )

    def match_exactly(self, request: Request, num_tokens: int) -> PrefixMatch | None:
        """The match serving exactly the first `num_tokens` tokens in this group, or None.

        A full-attention group needs every block below num_tokens; a sliding-window group only
        those its window sees from the first new token on (earlier entries are None). A partial
        last block needs a partial source with at least that many tokens. Does not modify the
        pool. Used by the hybrid manager to agree on one hit length across groups.
        """
        size = self.block_size
        num_full, num_partial = divmod(num_tokens, size)
        if num_tokens == 0:
            return NO_MATCH
        if not self.enable_caching or len(request.block_hashes) < num_full:
            return None
        first = self.first_needed_block(num_tokens)
        blocks: list[Block | None] = [None] * first
        for index in range(first, num_full):
            block = self.block_pool.get_cached_block(request.block_hashes[index], self.group)
            parent = self._hasher.parent_hash(request, index)
            if block is None or not self._holds(block, parent, request, index):
                return None
            blocks.append(block)
        partial = None
        if num_partial:
            if not self.enable_partial_reuse:
                return None
            parent = self._hasher.parent_hash(request, num_full)
            found = self._find_partial(request, parent, num_full, num_partial)
            if found is None or found.num_tokens < num_partial:
                return None
            partial = replace(found, num_tokens=num_partial)
        return PrefixMatch(blocks=tuple(blocks), num_tokens=num_tokens, partial=partial)

    def first_needed_block(self, num_computed: int) -> int:
        """Index of the first block a query at position >= num_computed still sees (0 for a
        full-attention group): blocks before it can be released."""
        if self.window is None:
            return 0
        return first_window_block(num_computed, self.block_size, self.window)

    def _holds(self, block: Block, parent: BlockHash, request: Request, index: int) -> bool:
        """True if `block` stores exactly full block `index` of `request` (not a hash collision)."""
        start = index * self.block_size
        return (
            block.parent_hash == parent
            and block.token_ids == tuple(request.all_token_ids[start : start + self.block_size])
            and block.extra_keys == self._hasher.extra_keys(request, index)
        )
