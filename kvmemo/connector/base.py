"""KVConnector: moves full KV blocks between the device pool and an external store.

Invariant: a block is marked computed from the store only when its validated payload is already
in hand (read and checksummed at match time), so it is copied into its page before the forward
that reads it; saves copy committed blocks off the device before the next schedule can evict them.

The API has two sides, like vLLM's kv_connector/v1/base.py. In kvmemo both live in one process
and one object; the split says who calls what. It holds only the calls the engine makes: loads
are synchronous and saves are per committed block, so vLLM's per-layer and async-completion
hooks have no caller here and are not part of it.

Scheduler side (called by the Scheduler, engine thread):
    get_num_new_matched_tokens(request, num_computed_tokens) -> num_tokens
        Tokens beyond the device hit held by the store as whole consecutive full blocks, from
        block num_computed_tokens // block_size on; at least one token is left to compute.
        Reads and validates those blocks now (a bad block ends the match).
    count_stored_tokens(request, num_computed_tokens) -> num_tokens
        The same run checked by existence only (no payload read, no match recorded): a cheap
        estimate of a later hit, for ordering the waiting queue. Default 0.
    update_state_after_alloc(request, block_ids, num_external_tokens)
        The first num_external_tokens // block_size of block_ids (the request's new blocks)
        receive the matched payloads in this step. Without this call, the match is dropped.
    build_connector_meta() -> ConnectorMetadata
        The step's loads (block_hash, block_id, payload); clears the scheduler-side state.
    blocks_to_save(events, lookup) -> list[(block_hash, block_id)]
        Committed blocks (from BlockStored events) that the store's admission takes
        (admission.py) and it does not have yet; lookup gives a hash's block id(s) on the
        device, or None.

A block id is a BlockIds: an int, or for a hybrid layout (layer groups with their own blocks,
kv/hybrid.py) one id per group, each layer's K/V living in its group's block. A payload always
holds every layer, so stores do not depend on how the device groups layers.

Worker side (called by the ModelRunner / engine, engine thread):
    register_kv_caches(kv_cache)         the paged K/V tensors loads and saves address.
    start_load_kv(metadata)              copies the step's payloads into their pages, before the
                                         forward (after partial-reuse block copies).
    save_blocks(blocks)                  copies committed blocks off the device (all layers' K
                                         and V) and hands them to the store's writer thread.
    wait_for_save()                      blocks until the store has written queued saves.

Both sides: stats -> ConnectorStats, the loads, saves and errors so far (EngineStats reads it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmemo.kv.hashing import BlockHash
from kvmemo.kv.match import BlockIds

if TYPE_CHECKING:
    from kvmemo.attention.cache import PagedKVCache
    from kvmemo.kv.events import KVEvent
    from kvmemo.request import Request



@dataclass(frozen=True, slots=True)
class BlockLoad:
    """One block to copy into the device pool before this step's forward."""

    block_hash: BlockHash
    block_id: BlockIds
    payload: bytes  # raw [num_layers, 2, block_size, num_kv_heads, head_dim] bytes, validated


@dataclass(frozen=True)
class ConnectorMetadata:
    """What the worker side must do this step (built by the scheduler side).

    Saves are not listed here: they happen after the step's commit, before the next schedule,
    via save_blocks(); a save carried to the next step's metadata could find its page evicted.
    """

    loads: tuple[BlockLoad, ...] = ()


@dataclass(frozen=True)
class ConnectorStats:
    """Cumulative store counters as the engine reports them."""

    hit_tokens: int = 0  # tokens served from the store
    miss_tokens: int = 0  # tokens beyond the device hit that the store did not have
    bytes_read: int = 0
    bytes_written: int = 0
    load_s: float = 0.0  # reading + validating + copying into pages
    save_s: float = 0.0  # copying off the device (engine thread) + encoding/writing (writer)
    saves_dropped: int = 0


class KVConnector(ABC):
    """The two-sided connector interface (see the module docstring for each primitive)."""

    # ---- scheduler side --------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int: ...

    def count_stored_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens of the store's consecutive full blocks after the device hit, checked by
        existence only (no payload read, no match recorded): a cheap estimate of a later hit."""
        return 0

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[BlockIds], num_external_tokens: int
    ) -> None: ...

    @abstractmethod
    def build_connector_meta(self) -> ConnectorMetadata: ...

    @abstractmethod
    def blocks_to_save(
        self, events: Sequence[KVEvent], lookup: Callable[[BlockHash], BlockIds | None]
    ) -> list[tuple[BlockHash, BlockIds]]: ...

    # ---- worker side -----------------------------------------------------------------------

    @abstractmethod
    def register_kv_caches(self, kv_cache: PagedKVCache) -> None: ...

    @abstractmethod
    def start_load_kv(self, metadata: ConnectorMetadata) -> None: ...

    @abstractmethod
    def save_blocks(self, blocks: Sequence[tuple[BlockHash, BlockIds]]) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    @property
    @abstractmethod
    def stats(self) -> ConnectorStats: ...
