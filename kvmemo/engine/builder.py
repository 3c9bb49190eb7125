"""build_engine: an EngineConfig becomes the engine's parts, each built once and wired together.

The one place that knows the construction order: the device, the model (its linear kernels
bound), the input processor, the KV layout and pool, the cache manager, the connector, the
scheduler and the drivers beside it, the model runner (attention backend, CUDA graphs), the
output processor and the draft proposer. Engine (engine.py) only runs them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmemo.attention.backend import select_attention_backend
from kvmemo.config import EngineConfig
from kvmemo.connector.line_log import disk_store_dir
from kvmemo.connector.store_connector import StoreKVConnector
from kvmemo.engine.beam_driver import BeamSearchDriver
from kvmemo.engine.blend_driver import BlendDriver, BlendSettings
from kvmemo.engine.code_pages import release_torch_code_pages
from kvmemo.engine.cpu_malloc import keep_freed_memory, return_freed_memory
from kvmemo.engine.cuda_graphs import DecodeGraphs, decode_graphs_apply
from kvmemo.engine.decode_chain import DecodeChain
from kvmemo.engine.encoder_cache import EncoderCache
from kvmemo.engine.kv_setup import build_kv, build_kv_connector
from kvmemo.engine.model_runner import ModelRunner
from kvmemo.engine.output_processor import OutputProcessor
from kvmemo.engine.sampler import Sampler
from kvmemo.engine.scheduler import Scheduler, SchedulerLimits
from kvmemo.intake.processor import InputProcessor
from kvmemo.kv.hashing import RequestHasher
from kvmemo.kv.hybrid import HybridKVCacheManager
from kvmemo.kv.layout import KVLayout
from kvmemo.kv.manager import KVCacheManager
from kvmemo.model.layers.linear import KernelChoice
from kvmemo.model.loading.loader import LoadedModel, load_model, resolve_weights_mode
from kvmemo.model.models.llama_fast import prepare as prepare_model
from kvmemo.spec.corpus_log import CorpusLog
from kvmemo.spec.policy import cost_table
from kvmemo.spec.proposer import DraftProposer
from kvmemo.units import parse_size_bytes

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for but no CUDA device is available; use 'cpu' or 'auto'"
        )
    return torch.device(name)


@dataclass
class EngineParts:
    """Everything an Engine runs, built by build_engine."""

    device: torch.device
    loaded: LoadedModel
    linear_kernels: KernelChoice
    processor: InputProcessor
    max_model_len: int
    eos_token_ids: frozenset[int]
    layout: KVLayout
    hasher: RequestHasher
    kv_manager: KVCacheManager | HybridKVCacheManager
    kv_connector: StoreKVConnector | None
    scheduler: Scheduler
    beams: BeamSearchDriver
    blends: BlendDriver
    runner: ModelRunner
    outputs: OutputProcessor
    drafts: DraftProposer | None  # speculative decoding's draft source, when configured


def build_engine(config: EngineConfig) -> EngineParts:
    """Build and wire every part of an engine for `config` (loads the model)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    if device.type == "cpu":
        keep_freed_memory()  # prefill's activations are reused, not page-faulted in again
        release_torch_code_pages()  # torch's import-time code, before the weights fill memory
    else:
        # cuBLAS may otherwise sum bf16/fp16 products in reduced precision (split-K):
        # kvmemo's half-precision mode keeps fp32 sums, as its CPU kernels do.
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    start = time.perf_counter()
    loaded = load_model(
        config.model, dtype=config.dtype, device=str(device), weights=config.weights
    )
    compute_dtype = loaded.dtype  # config.dtype, "auto" resolved
    if device.type == "cpu":
        # The tokenizer's parse freed ~75 MiB (Gemma 3) that the raised trim threshold keeps;
        # the repacked weights go to their own mappings (huge_pages.py), not into that heap.
        return_freed_memory()
    # Linear layers bind to the fastest kernels here (probed once per machine, cached); native
    # weights take the quantized kernels at every row count.
    linear_kernels = prepare_model(loaded.model)
    if device.type == "cpu":
        return_freed_memory()  # plain weights oneDNN no longer reads
    arch = loaded.arch_config
    processor = InputProcessor(
        loaded.tokenizer, arch.vocab_size, config.chat_template or loaded.chat_template,
        loaded.image_input, blend_separator=config.blend_separator,
    )
    max_model_len = min(
        config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings
    )
    eos_token_ids = frozenset(arch.eos_token_ids)

    layout, kv_cache = build_kv(
        config, loaded, compute_dtype, device, processor.encode_prompt, max_model_len,
    )
    manager_class = HybridKVCacheManager if layout.is_hybrid else KVCacheManager
    kv_manager = manager_class(
        layout,
        enable_caching=config.enable_prefix_caching,
        enable_partial_reuse=config.enable_partial_reuse,
        eviction_policy=config.eviction_policy,
        # The KV store saves what BlockStored events announce, so it needs them too.
        enable_events=config.enable_kv_events or config.kv_store is not None,
    )
    if config.max_retained_tokens is not None:
        kv_manager.max_retained_blocks = max(1, config.max_retained_tokens // layout.block_size)
    kv_connector = build_kv_connector(config, layout, loaded.path, kv_cache)
    scheduler = Scheduler(
        SchedulerLimits(config.max_num_batched_tokens, config.max_num_seqs, max_model_len),
        kv_manager,
        kv_connector,
    )
    beams = BeamSearchDriver(
        scheduler, kv_manager, eos_token_ids=eos_token_ids, vocab_size=arch.vocab_size,
        max_model_len=max_model_len,
    )
    blends = BlendDriver(
        scheduler, kv_manager, kv_connector,
        BlendSettings(config.blend_recompute_ratio, config.blend_check_layer,
                      config.blend_min_reuse),
    )
    encoder_cache = None
    if loaded.image_input is not None:
        capacity = parse_size_bytes(config.encoder_cache_memory, "encoder_cache_memory")
        encoder_cache = EncoderCache(capacity)
    runner = ModelRunner(
        loaded.model,
        kv_cache,
        Sampler(config.seed, device, eos_token_ids),
        scale=arch.attention_scale,
        device=device,
        attention_backend=select_attention_backend(
            config.attention_backend, arch.attention_scale, device, config.batch_invariant
        ),
        kv_connector=kv_connector,
        encoder_cache=encoder_cache,
        kv_groups=layout.groups,
        vocab_size=arch.vocab_size,
    )
    runner.track_block_generations(kv_manager.block_pool.generations)
    if decode_graphs_apply(device, runner.attention_backend.name, len(layout.groups),
                           config.enforce_eager):
        runner.decode_graphs = DecodeGraphs(
            loaded.model, kv_cache, runner.attention_backend, max_model_len,
            config.max_num_seqs, arch.num_attention_heads,
        )
    if not config.enforce_eager:
        runner.decode_chain = DecodeChain.build(loaded.model, kv_cache, runner.attention_backend,
                                                runner.scale)
    outputs = OutputProcessor(loaded.tokenizer, processor.reply_tokens, scheduler.finish_request)
    drafts = None
    if config.speculative_config is not None:
        weights = resolve_weights_mode(config.weights, Path(loaded.path), str(device))
        drafts = DraftProposer(config.speculative_config, max_model_len,
                               cost_table(device.type, weights), corpus_log(kv_connector))
    logger.info(
        "engine ready in %.1f s on %s (linear kernels: decode %s, prefill %s)",
        time.perf_counter() - start, device, linear_kernels.decode, linear_kernels.prefill,
    )
    return EngineParts(
        device=device, loaded=loaded, linear_kernels=linear_kernels, processor=processor,
        max_model_len=max_model_len, eos_token_ids=eos_token_ids, layout=layout,
        hasher=layout.new_hasher(), kv_manager=kv_manager, kv_connector=kv_connector,
        scheduler=scheduler, beams=beams, blends=blends, runner=runner, outputs=outputs,
        drafts=drafts,
    )


def corpus_log(connector: StoreKVConnector | None) -> CorpusLog | None:
    """The speculative corpus's file beside the disk KV store (in its model namespace's
    directory), if there is one; 64 MiB at most."""
    directory = disk_store_dir(connector)
    return None if directory is None else CorpusLog(directory, 64 * 2**20)
