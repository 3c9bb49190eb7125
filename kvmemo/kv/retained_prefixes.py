"""RetainedPrefixes: the KV manager's part in retention (retention.py): which blocks a
request's Retention ranges name in its layer group, and the per-cache_salt quota."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmemo.errors import InputError
from kvmemo.kv.retention import DEFAULT_OWNER, retained_tokens

if TYPE_CHECKING:
    from kvmemo.kv.block_pool import BlockPool
    from kvmemo.request import Request


class RetainedPrefixes:
    """The KV manager's part in retention: which blocks a request's ranges name, the quota."""

    block_pool: BlockPool
    block_size: int
    group: int
    window: int | None
    enable_caching: bool
    max_retained_blocks: int  # group-0 blocks one cache_salt may hold retained

    def retained_blocks_needed(self, request: Request) -> tuple[int, int]:
        """(blocks the request's retention would add for its cache_salt, blocks it holds now)."""
        pool, owner = self.block_pool, request.cache_salt or DEFAULT_OWNER
        end = min(retained_tokens(request.retention), request.num_prompt_tokens) // self.block_size
        new = sum(not pool.is_retained(h, owner) for h in request.block_hashes[:end])
        return new, pool.retained_blocks(owner)

    def check_retention(self, request: Request) -> None:
        """Raises InputError (param "retention") if the request's retention would take its
        cache_salt past max_retained_blocks."""
        if not request.retention or not self.enable_caching:
            return
        new, held = self.retained_blocks_needed(request)
        if new + held > self.max_retained_blocks:
            size, salt = self.block_size, request.cache_salt
            raise InputError(
                "retention",
                f"retaining this prompt's cache would hold {(new + held) * size:,} tokens for "
                f"cache_salt {salt!r} ({held * size:,} held now, {new * size:,} more asked); "
                f"the limit is {self.max_retained_tokens:,} tokens per cache_salt "
                f"(--max-retained-tokens)",
            )

    @property
    def max_retained_tokens(self) -> int:
        return self.max_retained_blocks * self.block_size

    def retain(self, request: Request) -> None:
        """Retains the cached blocks of each of the request's Retention ranges, from now for
        its seconds (call before free). In a sliding-window group only the blocks a hit at the
        range's end reads: the window before it."""
        if not request.retention or not self.enable_caching:
            return
        pool, size = self.block_pool, self.block_size
        now, owner = pool.retention.clock(), request.cache_salt or DEFAULT_OWNER
        for retention in request.retention:
            end = min(retention.num_tokens, request.num_prompt_tokens) // size
            start = 0 if self.window is None else max(0, end - self.window // size - 2)
            pool.retain(request.block_hashes[start:end], self.group, now + retention.seconds,
                        owner, self.max_retained_blocks)
