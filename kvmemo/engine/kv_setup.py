"""The KV factory: an engine's KVLayout, its paged cache and its store connector, built once.

Invariant: the layout is derived here and only here (block size, pool size, KV dtype, namespace
root, layer groups); the hasher, the manager, the paged cache and the connector all take it from
the result, so no second holder of these numbers exists to disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from kvmemo.attention.cache import (
    PagedKVCache,
    describe_kv_bytes,
    kv_bytes_per_token,
    resolve_kv_dtype,
)
from kvmemo.attention.fp8 import calibrate_kv_scales, calibration_segments
from kvmemo.config import EngineConfig
from kvmemo.connector.store import BlockStore
from kvmemo.connector.store_connector import StoreKVConnector
from kvmemo.connector.tiered import TieredStore
from kvmemo.errors import InputError
from kvmemo.kv.hashing import namespace_root_hash
from kvmemo.kv.layout import KVLayout, attention_type_groups, layer_slots
from kvmemo.model.loading.loader import LoadedModel

logger = logging.getLogger(__name__)


def build_kv(
    config: EngineConfig,
    loaded: LoadedModel,
    compute_dtype: torch.dtype,
    device: torch.device,
    encode_prompt: Callable[[str], list[int]],
    max_model_len: int | None = None,
) -> tuple[KVLayout, PagedKVCache]:
    """Sizes and allocates the paged KV pool, calibrates fp8 scales, and roots the namespace.

    The pool is kv_cache_memory's worth of blocks (or num_blocks), but never more than
    max_num_seqs sequences of max_model_len tokens can hold at once."""
    arch = loaded.arch_config
    num_layers, num_kv_heads, head_dim = (
        arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
    )
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, compute_dtype)
    # Sliding-window layers (Gemma 3) get their own groups, whose blocks leave with the window.
    groups = attention_type_groups([arch.layer_window(i) for i in range(num_layers)])
    slots = layer_slots(groups)
    layers_per_block = max(len(g.layer_indices) for g in groups)
    bytes_per_token = kv_bytes_per_token(layers_per_block, num_kv_heads, head_dim, kv_dtype)
    num_blocks = config.num_blocks or config.kv_cache_memory_bytes // (
        bytes_per_token * config.block_size
    )
    if config.num_blocks is None and max_model_len is not None:
        # No larger than max_num_seqs sequences of the whole context can use.
        needed = config.max_num_seqs * sum(
            g.max_blocks(config.block_size, max_model_len, config.max_num_batched_tokens)
            for g in groups
        )
        if needed < num_blocks:
            logger.info(
                "KV pool: %d blocks, what %d sequences of %d tokens can hold (kv_cache_memory "
                "allows %d)", needed, config.max_num_seqs, max_model_len, num_blocks,
            )
            num_blocks = needed
    if num_blocks < 1:
        raise InputError(
            "kv_cache_memory",
            f"kv_cache_memory {config.kv_cache_memory!r} is smaller than one block "
            f"({bytes_per_token * config.block_size} bytes)",
        )
    kv_cache = PagedKVCache.allocate(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=config.block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=kv_dtype,
        device=device,
        slot_of_layer=[slots[layer][1] for layer in range(num_layers)],
        group_of_layer=[slots[layer][0] for layer in range(num_layers)],
    )
    kv_namespace = str(kv_dtype)
    if kv_cache.is_fp8:  # per-(layer, kv head) transform from a fixed text: same weights, same one
        scales = calibrate_kv_scales(
            loaded.model, calibration_segments(encode_prompt), num_layers, num_kv_heads
        )
        kv_cache.set_scales(scales.k, scales.v, k_offsets=scales.k_offset,
                            v_offsets=scales.v_offset, rotation=scales.rotation)
        kv_namespace += f":scales={scales.digest()}"  # other scales, other blocks
    # The compute dtype changes the KV of the same weights, so it joins the fingerprint (below
    # fp32 with the fp32 residual stream's tag: KV saved by the older all-bf16 model differs);
    # so do native weights (int8 activations in decode steps), so that a shared store never
    # mixes their blocks with the exact mode's.
    native = ":native" if getattr(loaded.model, "native_parts", None) else ""
    dtype_tag = str(compute_dtype).removeprefix("torch.")
    if compute_dtype != torch.float32:
        dtype_tag += "+fp32-stream"
    root = namespace_root_hash(
        weights_fingerprint=f"{loaded.weights_fingerprint}:{dtype_tag}{native}",
        kv_cache_dtype=kv_namespace,
        block_size=config.block_size,
        algorithm=config.prefix_cache_hash,
    )
    layout = KVLayout(
        block_size=config.block_size,
        num_blocks=num_blocks,
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        bytes_per_token=bytes_per_token,
        namespace_root=root,
        hash_algorithm=config.prefix_cache_hash,
        groups=groups,
    )
    logger.info(
        "KV cache: %d blocks x %d tokens x %d layers, %s, %.2f GiB%s",
        num_blocks, config.block_size, layers_per_block,
        describe_kv_bytes(num_layers, num_kv_heads, head_dim, kv_dtype),
        layout.pool_bytes / 2**30,
        f", {len(groups)} layer groups (sliding window)" if layout.is_hybrid else "",
    )
    return layout, kv_cache


def build_kv_connector(
    config: EngineConfig, layout: KVLayout, model_path: str, kv_cache: PagedKVCache
) -> StoreKVConnector | None:
    """The connector over config.kv_store's tiers (None when no store is configured)."""
    if config.kv_store is None:
        return None
    from kvmemo.connector.admission import StoreAdmission
    from kvmemo.connector.spec import parse_kv_stores
    from kvmemo.connector.store_connector import namespace_for

    namespace = namespace_for(layout.namespace_root, Path(model_path).stem, kv_cache)
    tiers: list[tuple[str, BlockStore]] = []
    for i, spec in enumerate(parse_kv_stores(config.kv_store)):
        names = {name for name, _ in tiers}
        name = spec.kind if spec.kind not in names else f"{spec.kind}{i}"
        if spec.kind == "redis":
            from kvmemo.connector.redis_store import RedisStore  # needs the `redis` package

            assert spec.timeout_s is not None
            tiers.append((name, RedisStore(spec.path, namespace, timeout_s=spec.timeout_s)))
            logger.info("KV store tier %s: %s (timeout %.2f s)", name, spec.path, spec.timeout_s)
        else:
            from kvmemo.connector.disk import DiskStore

            assert spec.capacity_bytes is not None
            disk = DiskStore(spec.path, spec.capacity_bytes, namespace, eviction=spec.eviction)
            tiers.append((name, disk))
            logger.info(
                "KV store tier %s: %s (capacity %.1f GiB, eviction %s)",
                name, disk.dir, spec.capacity_bytes / 2**30, spec.eviction,
            )
    # One store is used as is (its own type stays visible); several become one TieredStore.
    store: BlockStore = tiers[0][1] if len(tiers) == 1 else TieredStore(tiers)
    # The doorkeeper remembers as many committed blocks as the pool's eviction ghosts do.
    admission = StoreAdmission(config.kv_store_admission, 4 * layout.num_blocks)
    return StoreKVConnector(store, namespace, layout.block_size, admission)
