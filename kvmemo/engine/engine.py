"""Engine: schedule -> execute -> update, one step at a time; the only place wiring kv/, model/
and attention/ together.

Invariant: after step() returns, every block whose KV the step computed is committed (reusable;
a beam search's generated blocks only when the search ends, see BeamSearch),
and every finished request's blocks are free (still cached until evicted).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvmemo.attention.cache import PagedKVCache, describe_kv_bytes, kv_bytes_per_token, resolve_kv_dtype
from kvmemo.attention.fp8 import calibrate_kv_scales, calibration_segments
from kvmemo.config import EngineConfig, parse_size_bytes
from kvmemo.connector.store_connector import StoreKVConnector
from kvmemo.connector.tiered import TierStats, TieredStore
from kvmemo.engine.beam_search import BeamSearch, BeamSearchParams
from kvmemo.engine.cpu_malloc import keep_freed_memory
from kvmemo.engine.detokenizer import IncrementalDetokenizer
from kvmemo.engine.encoder_cache import EncoderCache
from kvmemo.engine.model_runner import ModelRunner
from kvmemo.engine.processor import InputProcessor, ProcessedPrompt
from kvmemo.engine.sampler import Sampler
from kvmemo.engine.scheduler import Scheduler, SchedulerLimits
from kvmemo.kv.events import KVEvent
from kvmemo.kv.hashing import RequestHasher, namespace_root_hash
from kvmemo.kv.manager import KVCacheManager
from kvmemo.model.loader import load_model
from kvmemo.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvmemo.request import Request, RequestStatus
from kvmemo.sampling import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


@dataclass
class _Tracked:
    """Engine-side state of one request: its text so far and what the caller was sent."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    beam_search: BeamSearch | None = None


class Engine:
    """Owns the model runner, the scheduler and the KV cache manager."""

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # prefill's activations are reused, not page-faulted in again
        start = time.perf_counter()
        loaded = load_model(config.model, dtype=_DTYPES[config.dtype], device=str(self.device))
        self.loaded = loaded
        arch = loaded.arch_config
        self.tokenizer = loaded.tokenizer
        self.processor = InputProcessor(
            loaded.tokenizer, arch.vocab_size, loaded.chat_template, loaded.image_input
        )
        self.max_model_len = min(config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
        self.eos_token_ids = frozenset(arch.eos_token_ids)

        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, _DTYPES[config.dtype])
        bytes_per_token = kv_bytes_per_token(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, kv_dtype)
        num_blocks = config.num_blocks or config.kv_cache_memory_bytes // (bytes_per_token * config.block_size)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory {config.kv_cache_memory!r} is smaller than one block "
                f"({bytes_per_token * config.block_size} bytes)"
            )
        kv_cache = PagedKVCache.allocate(
            num_layers=arch.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=config.block_size,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            dtype=kv_dtype,
            device=self.device,
        )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %s, %.2f GiB",
            num_blocks, config.block_size, num_blocks * config.block_size,
            describe_kv_bytes(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, kv_dtype),
            num_blocks * config.block_size * bytes_per_token / 2**30,
        )
        self.kv_bytes_per_token = bytes_per_token
        kv_namespace = str(kv_dtype)
        if kv_cache.is_fp8:  # per-(layer, kv head) transform from a fixed text: same weights, same one
            scales = calibrate_kv_scales(
                loaded.model, calibration_segments(self.processor.encode_prompt),
                arch.num_hidden_layers, arch.num_key_value_heads,
            )
            kv_cache.set_scales(scales.k, scales.v, k_offsets=scales.k_offset,
                                v_offsets=scales.v_offset, rotation=scales.rotation)
            kv_namespace += f":scales={scales.digest()}"  # other scales, other blocks
        root = namespace_root_hash(
            # The compute dtype changes the KV of the same weights, so it joins the fingerprint.
            weights_fingerprint=f"{loaded.weights_fingerprint}:{config.dtype}",
            kv_cache_dtype=kv_namespace,
            block_size=config.block_size,
            algorithm=config.prefix_cache_hash,
        )
        self.hasher = RequestHasher(root, config.block_size, config.prefix_cache_hash)
        self.kv_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            self.hasher,
            enable_caching=config.enable_prefix_caching,
            enable_partial_reuse=config.enable_partial_reuse,
            # The KV store saves what BlockStored events announce, so it needs them too.
            enable_events=config.enable_kv_events or config.kv_store is not None,
        )
        self.kv_connector = _build_kv_connector(config, root, loaded.path, kv_cache)
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len),
            self.kv_manager,
            self.hasher,
            self.kv_connector,
        )
        self.runner = ModelRunner(
            loaded.model,
            kv_cache,
            Sampler(config.seed, self.device),
            scale=arch.head_dim**-0.5,
            device=self.device,
            kv_connector=self.kv_connector,
            encoder_cache=(
                EncoderCache(parse_size_bytes(config.encoder_cache_memory, "encoder_cache_memory"))
                if loaded.image_input is not None
                else None
            ),
        )
        self._tracked: dict[str, _Tracked] = {}
        self._kv_event_subscribers: list[Callable[[list[KVEvent]], None]] = []
        self._ids = itertools.count()
        self.num_steps = 0
        logger.info("engine ready in %.1f s on %s", time.perf_counter() - start, self.device)

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int] | ProcessedPrompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        prompt_text: str | None = None,
    ) -> str:
        """Tokenize, validate and queue one sequence. Returns its request id.

        A ProcessedPrompt (from self.processor.process / process_chat) carries images.
        """
        params = params or SamplingParams()
        request = self._new_request(prompt, params, request_id, cache_salt)
        request_id = request.request_id
        self.scheduler.add_request(request)
        self._tracked[request_id] = _Tracked(
            request=request,
            prompt=prompt if isinstance(prompt, str) else (prompt_text or _processed_text(prompt)),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop_strings),
            logprobs=[] if params.logprobs is not None else None,
        )
        return request_id

    def add_beam_request(
        self,
        prompt: str | list[int] | ProcessedPrompt,
        params: BeamSearchParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        prompt_text: str | None = None,
    ) -> str:
        """Tokenize, validate and queue one beam search (see BeamSearch). Returns its request id;
        its one RequestOutput comes when it finishes, with the beams best first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        # Only max_tokens matters to the scheduler; beams never go through the sampler.
        root_params = SamplingParams(max_tokens=params.max_tokens, temperature=0.0)
        root = self._new_request(prompt, root_params, request_id, cache_salt)
        request_id = root.request_id
        search = BeamSearch(
            root,
            params,
            self.kv_manager,
            eos_token_ids=self.eos_token_ids,
            max_new_tokens=min(params.max_tokens, self.max_model_len - root.num_prompt_tokens),
        )
        if search.num_candidates > self.loaded.arch_config.vocab_size:
            raise ValueError(
                f"beam_width {params.beam_width} is too large for a vocabulary of "
                f"{self.loaded.arch_config.vocab_size} tokens"
            )
        self.scheduler.add_request(root, search)
        self._tracked[request_id] = _Tracked(
            request=root,
            prompt=prompt if isinstance(prompt, str) else (prompt_text or _processed_text(prompt)),
            detokenizer=IncrementalDetokenizer(self.tokenizer, ()),
            logprobs=None,
            beam_search=search,
        )
        return request_id

    def _new_request(
        self,
        prompt: str | list[int] | ProcessedPrompt,
        params: SamplingParams,
        request_id: str | None,
        cache_salt: str | None,
    ) -> Request:
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        processed = prompt if isinstance(prompt, ProcessedPrompt) else self.processor.process(prompt)
        return Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=processed.token_ids,
            sampling_params=params,
            mm_items=list(processed.mm_items),
            mm_data=list(processed.mm_data),
            cache_salt=cache_salt,
            eos_token_ids=self.eos_token_ids,
        )

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._tracked.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that got a token or finished."""
        output = self.scheduler.schedule()
        result = self.runner.execute(output)
        self.num_steps += 1
        sampled = {rid: t.token_id for rid, t in result.sampled.items()}
        touched = self.scheduler.update_from_output(output, sampled, result.beam_logprobs)
        self._publish_kv_events()
        now = time.monotonic()
        outputs = []
        for request in touched:
            tracked = self._tracked[request.request_id]
            if tracked.beam_search is not None:  # touched only when it finished
                outputs.append(self._make_beam_output(tracked, now))
                del self._tracked[request.request_id]
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            token = result.sampled[request.request_id]
            if tracked.logprobs is not None:
                entry = dict(token.top_logprobs or {})
                entry[token.token_id] = token.logprob
                tracked.logprobs.append(entry)
            if tracked.detokenizer.add_token(token.token_id, is_last=request.is_finished):
                request.stop_reason = tracked.detokenizer.stop_reason
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            outputs.append(self._make_output(tracked, now))
            if request.is_finished:
                del self._tracked[request.request_id]
        return outputs

    def _make_output(self, tracked: _Tracked, now: float) -> RequestOutput:
        request = tracked.request
        completion = CompletionOutput(
            index=0,
            text=tracked.detokenizer.text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=tracked.logprobs,
        )
        metrics = RequestMetrics(
            arrival_time=request.arrival_time,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            first_token_time=request.first_token_time,
            finished_time=now if request.is_finished else None,
            num_preemptions=request.num_preemptions,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            metrics=metrics,
        )

    def _make_beam_output(self, tracked: _Tracked, now: float) -> RequestOutput:
        request, search = tracked.request, tracked.beam_search
        assert search is not None
        request.first_token_time = request.first_token_time or now
        completions = [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(beam.request.output_token_ids, skip_special_tokens=True),
                token_ids=list(beam.request.output_token_ids),
                finish_reason="stop" if beam.ended_with_eos else "length",
                stop_reason=beam.request.output_token_ids[-1] if beam.ended_with_eos else None,
                cumulative_logprob=beam.cumulative_logprob,
                score=beam.score,
            )
            for i, beam in enumerate(search.finished)
        ]
        out = self._make_output(tracked, now)
        out.outputs = completions
        return out

    def get_metrics(self) -> dict[str, float | int]:
        stats = self.kv_manager.stats
        return {
            "num_steps": self.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_num_blocks": self.kv_manager.num_blocks,
            "kv_num_free_blocks": self.kv_manager.num_free_blocks,
            "kv_usage": self.kv_manager.usage,
            "prefix_cache_queries_tokens": stats.num_queries_tokens,
            "prefix_cache_hits_tokens": stats.num_hit_tokens,
            "prefix_cache_partial_hit_tokens": stats.num_partial_hit_tokens,
            "prefix_cache_hit_rate": stats.hit_rate,
            "prefix_cache_evicted_blocks": stats.num_evicted_blocks,
            "prefix_cache_stored_blocks": stats.num_stored_blocks,
            **self._store_metrics(),
            **self._encoder_metrics(),
        }

    def _encoder_metrics(self) -> dict[str, float | int]:
        cache = self.runner.encoder_cache
        if cache is None:
            return {}
        return {
            "mm_encoder_images": cache.stats.num_encoded_images,
            "mm_encoder_calls": cache.stats.num_encoder_calls,
            "mm_encoder_cache_hits": cache.stats.num_hits,
            "mm_encoder_cache_bytes": cache.total_bytes,
        }

    def _store_metrics(self) -> dict[str, float | int]:
        if self.kv_connector is None:
            return {}
        s = self.kv_connector.stats
        return {
            "store_hit_tokens": s.hit_tokens,
            "store_miss_tokens": s.miss_tokens,
            "store_bytes_read": s.bytes_read,
            "store_bytes_written": s.bytes_written,
            "store_load_s": s.load_s,
            "store_save_s": s.save_s,
            "store_saves_dropped": s.saves_dropped,
            **{
                f"store_tier_{t.name}_{key}": value
                for t in _tier_stats(self.kv_connector)
                for key, value in (
                    ("served_blocks", t.served_blocks),
                    ("miss_blocks", t.store.num_misses),
                    ("errors", t.num_errors),
                )
            },
        }

    def subscribe_kv_events(self, callback: Callable[[list[KVEvent]], None]) -> None:
        """Call `callback` after every step that changed the block map, with its events in order.

        Raises ValueError unless the engine was built with enable_kv_events=True (collecting
        events costs memory, so they are off by default).
        """
        if not self.config.enable_kv_events:
            raise ValueError("KV events are off; build the engine with enable_kv_events=True")
        self._kv_event_subscribers.append(callback)

    def _publish_kv_events(self) -> None:
        """Drains the step's KV events once and fans them out: the KV store, then subscribers.

        The store copies newly committed blocks off the device here, before the next schedule
        can evict their pages.
        """
        if not self.config.enable_kv_events and self.kv_connector is None:
            return
        events = self.kv_manager.take_events()
        if not events:
            return
        if self.kv_connector is not None:
            lookup = self.kv_manager.block_pool.get_cached_block
            self.kv_connector.save_blocks(self.kv_connector.blocks_to_save(events, lookup))
        if self.config.enable_kv_events:
            for callback in self._kv_event_subscribers:
                callback(events)

    def flush_kv_store(self) -> None:
        """Blocks until the KV store has written every queued save (no-op without a store)."""
        if self.kv_connector is not None:
            self.kv_connector.wait_for_save()

    def reset_prefix_cache(self) -> tuple[bool, str]:
        """Drop every cached block; refused (False, reason) while requests hold blocks."""
        result = self.kv_manager.reset_prefix_cache()
        self._publish_kv_events()
        return result


def _tier_stats(connector: StoreKVConnector) -> list[TierStats]:
    store = connector.store
    if isinstance(store, TieredStore):
        return store.tier_stats()
    # One store, not wrapped: every hit it counted was served.
    name = "redis" if hasattr(store, "url") else "disk"
    s = store.stats
    return [TierStats(name, s.num_hits, s, getattr(store, "num_errors", 0))]


def _processed_text(prompt: list[int] | ProcessedPrompt) -> str | None:
    return prompt.text if isinstance(prompt, ProcessedPrompt) else None


def _build_kv_connector(
    config: EngineConfig, root: bytes, model_path: str, kv_cache: PagedKVCache
) -> StoreKVConnector | None:
    """The connector over config.kv_store's tiers (None when no store is configured)."""
    if config.kv_store is None:
        return None
    from kvmemo.connector.spec import parse_kv_stores
    from kvmemo.connector.store_connector import namespace_for

    namespace = namespace_for(root, Path(model_path).stem, kv_cache)
    tiers = []
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
            store = DiskStore(spec.path, spec.capacity_bytes, namespace)
            tiers.append((name, store))
            logger.info(
                "KV store tier %s: %s (capacity %.1f GiB)",
                name, store.dir, spec.capacity_bytes / 2**30,
            )
    # One store is used as is (its own type stays visible); several become one TieredStore.
    store = tiers[0][1] if len(tiers) == 1 else TieredStore(tiers)
    return StoreKVConnector(store, namespace, config.block_size)
