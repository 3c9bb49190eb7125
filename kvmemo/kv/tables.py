"""BlockTables: the KV cache manager's block tables as others read them (ids per request, where
store loads go) and their invariant checks (tests and debugging call them).

Checked: every block's ref_count equals the block tables holding it, committed blocks carry their
request's hashes, released sliding-window entries lie before the window, and the partial index
holds only unshared, unhashed blocks whose stored tokens are the request's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmemo.kv.block_pool import BlockPool
from kvmemo.kv.hashing import RequestHasher
from kvmemo.kv.match import BlockIds
from kvmemo.kv.matcher import RequestBlocks
from kvmemo.kv.partial_index import PartialIndex

if TYPE_CHECKING:
    from kvmemo.request import Request


class BlockTables:
    """The table views and checks of KVCacheManager, over the state it owns (declared here)."""

    block_size: int
    group: int
    block_pool: BlockPool
    _hasher: RequestHasher
    _partial: PartialIndex
    _requests: dict[str, RequestBlocks]

    first_needed_block: Callable[[int], int]  # PrefixMatcher's

    def get_block_table(self, request_id: str) -> list[int | None]:
        """The request's block ids in order ([] for a request that holds no blocks); None where
        a sliding-window group released a block."""
        state = self._requests.get(request_id)
        if state is None:
            return []
        return [b.block_id if b is not None else None for b in state.blocks]

    def get_group_block_tables(self, request_id: str) -> list[list[int | None]]:
        """[the block table]: the single-group form of HybridKVCacheManager's."""
        return [self.get_block_table(request_id)]

    def load_targets(self, request: Request, first: int, count: int) -> list[BlockIds]:
        """The ids of the request's blocks first..first+count-1 (where store loads go)."""
        table = self.get_block_table(request.request_id)[first : first + count]
        assert len(table) == count and all(b is not None for b in table), "load into no block"
        return [b for b in table if b is not None]

    def check_invariants(self) -> None:
        """Asserts pool invariants, ref_count == holders, and the partial index contents."""
        self.block_pool.check_invariants()
        self.check_tables(self.holder_counts())

    def holder_counts(self) -> dict[int, int]:
        """block_id -> block tables of this manager holding it."""
        holders: dict[int, int] = {}
        for state in self._requests.values():
            for block in state.blocks:
                if block is not None:
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
        return holders

    def check_tables(self, holders: dict[int, int]) -> None:
        """Asserts this group's tables and partial index, and ref_count == `holders` (the counts
        over every manager sharing the pool)."""
        size = self.block_size
        position: dict[int, tuple[RequestBlocks, int]] = {}
        for state in self._requests.values():
            request = state.request
            assert state.num_committed_blocks <= len(state.blocks)
            first = self.first_needed_block(request.num_computed_tokens)
            for index, block in enumerate(state.blocks):
                if block is None:
                    assert index < first, f"block {index} of {request.request_id!r} released early"
                    continue
                position[block.block_id] = (state, index)
                if block.block_hash is not None:
                    assert index < state.num_committed_blocks, "uncommitted block carries a hash"
                    assert block.block_hash == request.block_hashes[index], "foreign block hash"
                    assert block.group == self.group, f"block {block.block_id} of another group"
        for block in self.block_pool.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {holders.get(block.block_id, 0)} requests"
            )
        for entry in self._partial.entries():
            block = entry.block
            assert block.block_hash is None, f"partial entry on hashed block {block.block_id}"
            assert 0 < len(entry.token_ids) < size
            assert block.ref_count <= 1, f"partial block {block.block_id} is shared"
            if block.block_id in position:
                state, index = position[block.block_id]
                start = index * size
                stored = tuple(state.request.all_token_ids[start : start + len(entry.token_ids)])
                assert stored == entry.token_ids, f"stale partial entry, block {block.block_id}"
                assert entry.parent_hash == self._hasher.parent_hash(state.request, index)
