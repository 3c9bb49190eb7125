"""StoreKVConnector: the KVConnector over any BlockStore (disk, Redis, tiers).

It loads and saves by block.

Invariant: loads are only the validated payloads matched this step, for blocks the allocation
just handed out; each committed block is offered to the store at most once per process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvmemo.connector.admission import StoreAdmission
from kvmemo.connector.base import (
    BlockIds,
    BlockLoad,
    ConnectorMetadata,
    ConnectorStats,
    KVConnector,
)
from kvmemo.connector.store import BlockStore, StoreNamespace, get_many
from kvmemo.kv.events import BlockStored
from kvmemo.kv.hashing import BlockHash

if TYPE_CHECKING:
    from kvmemo.attention.cache import PagedKVCache
    from kvmemo.kv.events import KVEvent
    from kvmemo.request import Request

logger = logging.getLogger(__name__)

_TORCH_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",
}


def namespace_for(root_hash: bytes, model_name: str, kv_cache: PagedKVCache) -> StoreNamespace:
    """The store namespace of an engine: its root hash and its KV page layout."""
    k = kv_cache.k_caches[0]  # [num_blocks, block_size, Hkv, D]
    dtype = k.dtype
    if dtype not in _TORCH_DTYPE_NAMES:
        raise ValueError(
            f"KV dtype {dtype} cannot be stored; allowed: {list(_TORCH_DTYPE_NAMES.values())}"
        )
    return StoreNamespace(
        root_hash=bytes(root_hash),
        model_name=model_name,
        dtype=_TORCH_DTYPE_NAMES[dtype],
        block_shape=(len(kv_cache.k_caches), 2, k.shape[1], k.shape[2], k.shape[3]),
        itemsize=k.element_size(),
    )


@dataclass
class _Match:
    num_computed_tokens: int
    loads: list[tuple[BlockHash, bytes]]  # consecutive blocks from num_computed_tokens on


class StoreKVConnector(KVConnector):
    """Owns the step's pending loads and the load/save counters; the store owns the bytes."""

    def __init__(self, store: BlockStore, namespace: StoreNamespace, block_size: int,
                 admission: StoreAdmission | None = None):
        self.store = store
        self.admission = admission or StoreAdmission()
        self.namespace = namespace
        self.block_size = block_size
        self.kv_cache: PagedKVCache | None = None
        self._matches: dict[str, _Match] = {}  # request_id -> match not yet allocated
        self._loads: list[BlockLoad] = []  # this step's, confirmed by update_state_after_alloc
        self._hit_tokens = 0
        self._miss_tokens = 0
        self._load_s = 0.0
        self._copy_out_s = 0.0

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Whole consecutive store blocks after the device hit; their payloads are read now.

        Args:
            request: a request being admitted; its block_hashes cover its full blocks.
            num_computed_tokens: the device hit; a partial block in it is ignored (the store
                match starts at the block boundary num_computed_tokens // block_size).

        Returns:
            Tokens to load. A miss or an invalid block ends the match.
        """
        start = time.perf_counter()
        size = self.block_size
        first = num_computed_tokens // size
        self.admission.note_device_hits(request.block_hashes[:first])
        last = (len(request.all_token_ids) - 1) // size  # the last token is always computed
        loads: list[tuple[BlockHash, bytes]] = []
        wanted = request.block_hashes[first:last]
        # One batch per prefix: a remote store answers it in one round trip.
        for block_hash, payload in zip(wanted, get_many(self.store, wanted) if wanted else ()):
            if payload is None:
                break
            loads.append((block_hash, payload))
        self._matches[request.request_id] = _Match(first * size, loads)
        self._load_s += time.perf_counter() - start
        return len(loads) * size

    def count_stored_tokens(self, request: Request, num_computed_tokens: int) -> int:
        size = self.block_size
        first = num_computed_tokens // size
        last = (len(request.all_token_ids) - 1) // size  # the last token is always computed
        count = 0
        for block_hash in request.block_hashes[first:last]:
            if not self.store.contains(block_hash):
                break
            count += 1
        return count * size

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[BlockIds], num_external_tokens: int
    ) -> None:
        """Confirms the match: its payloads go into the first new blocks in this step."""
        match = self._matches.pop(request.request_id, None)
        num_loads = num_external_tokens // self.block_size
        if match is not None:
            queried = request.num_tokens - match.num_computed_tokens
            self._miss_tokens += max(0, queried - num_loads * self.block_size)
        if num_loads == 0:
            return
        if match is None or len(match.loads) < num_loads or len(block_ids) < num_loads:
            raise ValueError(
                f"num_external_tokens {num_external_tokens} exceeds the match for "
                f"{request.request_id!r} or its {len(block_ids)} new blocks"
            )
        for (block_hash, payload), block_id in zip(match.loads[:num_loads], block_ids):
            self._loads.append(BlockLoad(block_hash, block_id, payload))
        self._hit_tokens += num_loads * self.block_size

    def build_connector_meta(self) -> ConnectorMetadata:
        """The step's loads; matches never confirmed (deferred, not admitted) are dropped."""
        metadata = ConnectorMetadata(loads=tuple(self._loads))
        self._loads = []
        self._matches.clear()
        return metadata

    def blocks_to_save(
        self, events: Sequence[KVEvent], lookup: Callable[[BlockHash], BlockIds | None]
    ) -> list[tuple[BlockHash, BlockIds]]:
        """Blocks that entered the device map (BlockStored) and the admission writes, then blocks
        hit on the device that it writes now (admission.py), none already in the store; each
        step's in reverse, so a chain's head is written last and a store evicting its least
        recently written keeps it longest (tail first within a chain)."""
        candidates = [block_hash for event in events if isinstance(event, BlockStored)
                      for block_hash in event.block_hashes
                      if self.admission.admit_committed(block_hash)]
        candidates += self.admission.take_reused()
        out: list[tuple[BlockHash, BlockIds]] = []
        for block_hash in dict.fromkeys(candidates):
            block_ids = lookup(block_hash)
            if block_ids is not None and not self.store.contains(block_hash):
                out.append((block_hash, block_ids))
        out.reverse()
        return out

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: PagedKVCache) -> None:
        self.kv_cache = kv_cache

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Copies every load into its page (all layers), synchronously, before the forward."""
        if not metadata.loads:
            return
        cache = self._cache()
        start = time.perf_counter()
        device = cache.k_caches[0].device
        raw = bytearray(b"".join(load.payload for load in metadata.loads))
        # Copied as bytes: exact for every dtype, and fp8 index_copy_ has no CPU kernel.
        host = torch.frombuffer(raw, dtype=torch.uint8).view(
            len(metadata.loads), *self._byte_shape()
        )
        data = host.to(device)  # [n, L, 2, bs, Hkv, D * itemsize]
        ids_by_layer = self._ids_by_layer([load.block_id for load in metadata.loads], device)
        for layer, (k, v) in enumerate(zip(cache.k_caches, cache.v_caches)):
            ids = ids_by_layer[layer]
            k.view(torch.uint8).index_copy_(0, ids, data[:, layer, 0])
            v.view(torch.uint8).index_copy_(0, ids, data[:, layer, 1])
        self._load_s += time.perf_counter() - start

    def save_blocks(self, blocks: Sequence[tuple[BlockHash, BlockIds]]) -> None:
        """Copies the blocks' KV to host bytes now and queues them with the store."""
        if not blocks:
            return
        cache = self._cache()
        start = time.perf_counter()
        ids_by_layer = self._ids_by_layer([ids for _, ids in blocks], cache.k_caches[0].device)
        per_layer = [
            torch.stack(
                (
                    k.view(torch.uint8).index_select(0, ids_by_layer[layer]),
                    v.view(torch.uint8).index_select(0, ids_by_layer[layer]),
                ),
                dim=1,
            )
            for layer, (k, v) in enumerate(zip(cache.k_caches, cache.v_caches))
        ]  # each [n, 2, bs, Hkv, D * itemsize]
        host = torch.stack(per_layer, dim=1).cpu().contiguous()  # [n, L, 2, bs, Hkv, D * itemsize]
        raw = host.view(len(blocks), -1).numpy()
        for i, (block_hash, _) in enumerate(blocks):
            self.store.put(block_hash, raw[i].tobytes())
        self._copy_out_s += time.perf_counter() - start

    def wait_for_save(self) -> None:
        self.store.flush()

    @property
    def stats(self) -> ConnectorStats:
        store = self.store.stats
        return ConnectorStats(
            hit_tokens=self._hit_tokens,
            miss_tokens=self._miss_tokens,
            bytes_read=store.bytes_read,
            bytes_written=store.bytes_written,
            load_s=self._load_s,
            save_s=self._copy_out_s + store.save_s,
            saves_dropped=store.num_saves_dropped,
        )

    def _ids_by_layer(
        self, blocks: Sequence[BlockIds], device: torch.device
    ) -> list[torch.Tensor]:
        """Per layer, the page index of each block: its own id, or its layer group's id."""
        groups = self._cache().layer_groups
        if all(isinstance(ids, int) for ids in blocks):
            shared = torch.tensor(blocks, device=device)
            return [shared] * len(groups)
        rows = [ids if isinstance(ids, tuple) else (ids,) * len(set(groups)) for ids in blocks]
        by_group = torch.tensor(rows, device=device).T  # [G, n]
        return [by_group[group] for group in groups]

    def _byte_shape(self) -> tuple[int, ...]:
        *dims, head_dim = self.namespace.block_shape
        return (*dims, head_dim * self.namespace.itemsize)

    def _cache(self) -> PagedKVCache:
        if self.kv_cache is None:
            raise RuntimeError("register_kv_caches() must be called before loads or saves")
        return self.kv_cache
