"""Engine: schedule -> execute -> update, one step at a time; the only place wiring kv/, model/
and attention/ together.

Invariant: after step() returns, every block whose KV the step computed is committed (reusable;
a beam search's generated blocks only when the search ends, see BeamSearchDriver), and every
finished request's blocks are free (still cached until evicted). Callers use the methods below
and never reach into the parts: they take ProcessedPrompts (from `processor`, the one intake
path) and read EngineStats and KVInfo.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvmemo.attention.backend import select_attention_backend
from kvmemo.config import EngineConfig
from kvmemo.engine.beam_driver import BeamSearchDriver
from kvmemo.engine.beam_search import BeamSearch, BeamSearchParams
from kvmemo.engine.blend_driver import BlendDriver, BlendSettings, check_blend_supported
from kvmemo.engine.cpu_malloc import keep_freed_memory, return_freed_memory
from kvmemo.engine.cuda_graphs import DecodeGraphs, decode_graphs_apply
from kvmemo.engine.detokenizer import IncrementalDetokenizer
from kvmemo.engine.encoder_cache import EncoderCache
from kvmemo.engine.kv_setup import build_kv, build_kv_connector
from kvmemo.engine.model_runner import ModelRunner
from kvmemo.engine.sampler import Sampler
from kvmemo.engine.scheduler import Scheduler, SchedulerLimits
from kvmemo.engine.stats import EngineStats, KVInfo, MemoryStats, collect_stats
from kvmemo.errors import InputError
from kvmemo.intake.processor import InputProcessor, ProcessedPrompt
from kvmemo.kv.events import KVEvent
from kvmemo.kv.hashing import BlockHash
from kvmemo.kv.hybrid import HybridKVCacheManager
from kvmemo.kv.manager import KVCacheManager
from kvmemo.model.layers.native_linear import DenseCopies
from kvmemo.model.loading.loader import load_model
from kvmemo.model.models.llama_fast import prepare as prepare_model
from kvmemo.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvmemo.request import Request, RequestStatus
from kvmemo.sampling import SamplingParams
from kvmemo.structured.grammar import StructuredOutputCompiler
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
class _Tracked:
    """Engine-side state of one request: its text so far and what the caller was sent."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    beam_search: BeamSearch | None = None
    # Per prompt token (the first has none), when prompt logprobs were asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    blended: bool = False  # a segmented prompt run with kv_reuse="blend"


class Engine:
    """Owns the model runner, the scheduler, the KV cache manager and the beam search driver."""

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # prefill's activations are reused, not page-faulted in again
        else:
            # cuBLAS may otherwise sum bf16/fp16 products in reduced precision (split-K):
            # kvmemo's half-precision mode keeps fp32 sums, as its CPU kernels do.
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        start = time.perf_counter()
        loaded = load_model(
            config.model, dtype=config.dtype, device=str(self.device), weights=config.weights
        )
        compute_dtype = loaded.dtype  # config.dtype, "auto" resolved
        # Native weights may keep dense copies for batched steps, within this budget.
        loaded.model.dense_copies = DenseCopies(
            parse_size_bytes(config.dense_cache_memory, "dense_cache_memory",
                             allow_zero=True))
        # Linear layers bind to the fastest kernels here (probed once per machine, cached).
        self.linear_kernels = prepare_model(loaded.model)
        if self.device.type == "cpu":
            return_freed_memory()  # plain weights oneDNN no longer reads
        arch = loaded.arch_config
        self.loaded = loaded  # the model, its config, tokenizer and weights fingerprint
        self.weights_fingerprint = loaded.weights_fingerprint
        self.tokenizer = loaded.tokenizer
        self.processor = InputProcessor(
            loaded.tokenizer, arch.vocab_size, config.chat_template or loaded.chat_template,
            loaded.image_input, blend_separator=config.blend_separator,
        )
        self.max_model_len = min(
            config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings
        )
        self.eos_token_ids = frozenset(arch.eos_token_ids)

        self.layout, kv_cache = build_kv(
            config, loaded, compute_dtype, self.device, self.processor.encode_prompt,
            self.max_model_len,
        )
        self.hasher = self.layout.new_hasher()
        manager_class = HybridKVCacheManager if self.layout.is_hybrid else KVCacheManager
        self.kv_manager = manager_class(
            self.layout,
            enable_caching=config.enable_prefix_caching,
            enable_partial_reuse=config.enable_partial_reuse,
            # The KV store saves what BlockStored events announce, so it needs them too.
            enable_events=config.enable_kv_events or config.kv_store is not None,
        )
        self.kv_connector = build_kv_connector(config, self.layout, loaded.path, kv_cache)
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len),
            self.kv_manager,
            self.kv_connector,
        )
        self.beams = BeamSearchDriver(
            self.scheduler,
            self.kv_manager,
            eos_token_ids=self.eos_token_ids,
            vocab_size=arch.vocab_size,
            max_model_len=self.max_model_len,
        )
        self.blends = BlendDriver(
            self.scheduler,
            self.kv_manager,
            self.kv_connector,
            BlendSettings(
                config.blend_recompute_ratio, config.blend_check_layer, config.blend_min_reuse
            ),
        )
        encoder_cache = None
        if loaded.image_input is not None:
            capacity = parse_size_bytes(config.encoder_cache_memory, "encoder_cache_memory")
            encoder_cache = EncoderCache(capacity)
        self.runner = ModelRunner(
            loaded.model,
            kv_cache,
            Sampler(config.seed, self.device, self.eos_token_ids),
            scale=arch.attention_scale,
            device=self.device,
            attention_backend=select_attention_backend(
                config.attention_backend, arch.attention_scale, self.device
            ),
            kv_connector=self.kv_connector,
            encoder_cache=encoder_cache,
            kv_groups=self.layout.groups,
        )
        self.runner.track_block_generations(self.kv_manager.block_pool.generations)
        if decode_graphs_apply(self.device, self.runner.attention_backend.name,
                               len(self.layout.groups), config.enforce_eager):
            self.runner.decode_graphs = DecodeGraphs(
                loaded.model, kv_cache, self.runner.attention_backend, self.max_model_len,
                config.max_num_seqs, arch.num_attention_heads,
            )
        self._tracked: dict[str, _Tracked] = {}
        self._kv_event_subscribers: list[Callable[[list[KVEvent]], None]] = []
        self._structured: StructuredOutputCompiler | None = None
        self.num_steps = 0
        logger.info(
            "engine ready in %.1f s on %s (linear kernels: decode %s, prefill %s)",
            time.perf_counter() - start, self.device,
            self.linear_kernels.decode, self.linear_kernels.prefill,
        )

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue one sequence (params.n must be 1: see add_requests)."""
        if params.n != 1:
            raise ValueError("add_request runs one sequence; add params.per_sample() instead")
        vocab = self.processor.vocab_size
        for name, ids in (("logit_bias", params.logit_bias),
                          ("allowed_token_ids", params.allowed_token_ids)):
            if ids and max(ids) >= vocab:  # SamplingParams checked they are ids >= 0
                raise InputError(name, f"{name} token ids must be in [0, {vocab}), got {max(ids)}")
        if params.bad_words and not params.bad_words_token_ids:
            params = dataclasses.replace(
                params, bad_words_token_ids=self._bad_words_token_ids(params.bad_words)
            )
        constraint = None
        if params.structured_outputs is not None:
            # Compiled here, so a bad schema or regex fails this call (a 400), not a step.
            constraint = self._structured_compiler().constraint(params.structured_outputs)
        blended = self._wants_blend(prompt, params)
        if blended:
            request = self._add_blend_request(request_id, prompt, params, cache_salt, constraint)
        else:
            request = self._new_request(request_id, prompt, params, cache_salt)
            request.constraint = constraint
            self.scheduler.add_request(request)
        self._tracked[request_id] = _Tracked(
            request=request,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, params.stop_strings, params.skip_special_tokens,
                params.include_stop_str_in_output,
            ),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=(
                [None] * request.num_prompt_tokens if params.prompt_logprobs is not None else None
            ),
            blended=blended,
        )

    def _wants_blend(self, prompt: ProcessedPrompt, params: SamplingParams) -> bool:
        """True when the prompt is segmented, has chunks, and its kv_reuse (or the engine's
        default) is "blend"; raises InputError when this engine cannot blend it."""
        plan = prompt.segments
        if plan is None or (plan.kv_reuse or self.config.kv_reuse) != "blend":
            return False
        check_blend_supported(
            has_layers=hasattr(self.runner.model, "layers"),
            is_hybrid=self.layout.is_hybrid,
            is_fp8=self.runner.kv_cache.is_fp8,
            has_images=bool(prompt.mm_items),
            wants_prompt_logprobs=params.prompt_logprobs is not None,
        )
        if len(prompt.token_ids) >= self.max_model_len:
            raise InputError(
                "segments",
                f"the segments are {len(prompt.token_ids)} tokens in all; the model's context "
                f"is {self.max_model_len} tokens, so they must be at most "
                f"{self.max_model_len - 1}",
            )
        return len(plan.starts) >= 3  # no chunk between context and question: nothing to blend

    def _add_blend_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        cache_salt: str | None,
        constraint: object,
    ) -> Request:
        """Queues a segmented prompt through the blend driver (chunks first, or after it)."""
        plan = prompt.segments
        assert plan is not None

        def new_request(
            rid: str, token_ids: list[int], marker: tuple[int, str] | None,
            own_params: SamplingParams | None,
        ) -> Request:
            chunk_prompt = ProcessedPrompt(token_ids, prompt.text if own_params is None else None)
            request = self._new_request(rid, chunk_prompt, own_params or params, cache_salt,
                                        kv_marker=marker)
            if own_params is None:
                request.constraint = constraint
            return request

        return self.blends.add(
            plan.ranges(len(prompt.token_ids)), plan.recompute_ratio, new_request, request_id,
            prompt.token_ids,
        )

    def add_requests(
        self,
        batch: Sequence[tuple[str, ProcessedPrompt, SamplingParams | BeamSearchParams]],
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue every (request_id, prompt, params) of `batch` (one-sample SamplingParams, or
        BeamSearchParams for a beam search), or none of them: if one is refused (its ValueError
        propagates), those already queued are aborted."""
        added: list[str] = []
        try:
            for request_id, prompt, params in batch:
                if isinstance(params, BeamSearchParams):
                    self.add_beam_request(request_id, prompt, params, cache_salt=cache_salt)
                else:
                    self.add_request(request_id, prompt, params, cache_salt=cache_salt)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.abort_request(request_id)
            raise

    def add_beam_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: BeamSearchParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue one beam search (see BeamSearchDriver); its one RequestOutput comes
        when it finishes, with the beams best first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        # Only max_tokens matters to the scheduler; beams never go through the sampler.
        root_params = SamplingParams(max_tokens=params.max_tokens, temperature=0.0)
        root = self._new_request(request_id, prompt, root_params, cache_salt, sample_tokens=False)
        search = self.beams.add(root, params)
        self._tracked[request_id] = _Tracked(
            request=root,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ()),
            logprobs=None,
            beam_search=search,
        )

    def _new_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        cache_salt: str | None,
        *,
        sample_tokens: bool = True,
        kv_marker: tuple[int, str] | None = None,
    ) -> Request:
        if not isinstance(prompt, ProcessedPrompt):
            raise TypeError(
                f"prompt must be a ProcessedPrompt (from Engine.processor), "
                f"got {type(prompt).__name__}"
            )
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InputError(
                "cache_salt", f"cache_salt must be a non-empty string, got {cache_salt!r}"
            )
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling_params=params,
            mm_items=list(prompt.mm_items),
            mm_data=list(prompt.mm_data),
            cache_salt=cache_salt,
            eos_token_ids=self.eos_token_ids,
            hasher=self.hasher,
            sample_tokens=sample_tokens,
            prompt_text=prompt.text,
            kv_marker=kv_marker,
        )

    def _bad_words_token_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens alone and after a space (as vLLM): a word mid-sentence is
        usually one token with the space folded in, at the start of the output another."""
        sequences: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    sequences[ids] = None
        return tuple(sequences)

    def _structured_compiler(self) -> StructuredOutputCompiler:
        """Built on first use: reading the vocabulary into the grammar library takes ~0.1 s."""
        if self._structured is None:
            self._structured = StructuredOutputCompiler(
                self.tokenizer, self.processor.vocab_size, self.eos_token_ids
            )
        return self._structured

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks (idempotent; unknown ids are ignored)."""
        if not self.beams.abort(request_id):
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.blends.abort(request_id)
        self._tracked.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission: the queue depth."""
        return len(self.scheduler.waiting)

    # ---- the loop --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that got a token or finished."""
        output = self.scheduler.schedule()
        result = self.runner.execute(output)
        self.num_steps += 1
        sampled = {rid: t.token_id for rid, t in result.sampled.items()}
        touched = self.scheduler.update_from_output(output, sampled)
        for request_id, reused in result.blend_counts.items():
            blended = self._tracked.get(request_id)
            spec = blended.request.blend if blended is not None else None
            if spec is not None:
                spec.num_reused_tokens = reused
        if self.blends.is_driving:
            # Chunk sequences are the blend driver's: their tokens are never shown (sorted out
            # first: the driver forgets a chunk once its blend moves on).
            chunks = [r for r in touched if self.blends.is_chunk(r.request_id)]
            touched = [r for r in touched if not self.blends.is_chunk(r.request_id)]
            self.blends.after_step(chunks + touched)
        for request_id, (first, entries) in result.prompt_logprobs.items():
            # By position: a preempted request recomputes its prompt and rewrites the same.
            tracked_request = self._tracked.get(request_id)
            tracked_prompt = tracked_request.prompt_logprobs if tracked_request else None
            if tracked_prompt is not None:
                tracked_prompt[first : first + len(entries)] = entries
        ended = (
            self.beams.after_step(result.logprobs_rows, output.preempted_request_ids)
            if self.beams.searches
            else []
        )
        self._publish_kv_events()
        now = time.monotonic()
        outputs = []
        for request in touched:
            tracked = self._tracked[request.request_id]
            if request.first_token_time is None:
                request.first_token_time = now
            token = result.sampled[request.request_id]
            if request.constraint is not None and not request.constraint.accept(token.token_id):
                # Only a sampler fallback (a row left with no usable probability) gets here.
                logger.error("request %s: token %d breaks its grammar; stopping it",
                             request.request_id, token.token_id)
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            if tracked.logprobs is not None:
                assert token.logprob is not None, "the sampler returns it when logprobs is set"
                entry = dict(token.top_logprobs or {})
                entry[token.token_id] = token.logprob
                tracked.logprobs.append(entry)
            # The EOS or stop token id that ended the output leaves no text (vLLM's rule), unless
            # the stop is to be included.
            shown = not (
                request.status == RequestStatus.FINISHED_STOPPED
                and request.stop_reason == token.token_id
                and not request.sampling_params.include_stop_str_in_output
            )
            if tracked.detokenizer.add_token(
                token.token_id, is_last=request.is_finished, shown=shown
            ):
                request.stop_reason = tracked.detokenizer.stop_reason
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            if not shown:  # ended by EOS or a stop token id: the text is all of the rest
                self.processor.reply_tokens.remember(
                    tracked.detokenizer.text, request.output_token_ids[:-1], request.cache_salt
                )
            outputs.append(self._make_output(tracked, now))
            if request.is_finished:
                del self._tracked[request.request_id]
        for search in ended:
            tracked = self._tracked.pop(search.root.request_id)
            outputs.append(self._make_beam_output(tracked, now))
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
        if tracked.blended:
            spec = request.blend
            reused = spec.num_reused_tokens if spec is not None else 0
            metrics.num_blended_tokens = reused
            metrics.num_recomputed_tokens = (
                request.num_prompt_tokens - metrics.num_cached_tokens - reused
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt_text,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            metrics=metrics,
            prompt_logprobs=tracked.prompt_logprobs,
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

    # ---- what the engine tells the outside -------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of the counters, the queue and the pool (call between steps)."""
        return collect_stats(
            self.num_steps, self.scheduler, self.kv_manager, self.kv_connector,
            self.runner.encoder_cache,
        )

    def kv_info(self) -> KVInfo:
        """How this engine names its blocks (what a router needs to hash prompts alike)."""
        layout = self.layout
        return KVInfo(
            weights_fingerprint=self.weights_fingerprint,
            namespace_root=layout.namespace_root,
            block_size=layout.block_size,
            hash_algorithm=layout.hash_algorithm,
            num_blocks=layout.num_blocks,
            kv_cache_dtype=layout.kv_cache_dtype,
        )

    def memory_stats(self) -> MemoryStats:
        """Weights as held, the KV pool's size, and the process's peak RSS."""
        return MemoryStats(
            weights_bytes=self.loaded.model.weight_bytes(),
            kv_pool_bytes=self.layout.pool_bytes,
            peak_rss_bytes=_peak_rss_bytes(),
        )

    def cached_block_hashes(self) -> list[BlockHash]:
        """Hashes of every block a prompt could hit right now (call between steps)."""
        return self.kv_manager.block_pool.cached_block_hashes()

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
            lookup = self.kv_manager.cached_block_ids
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


def _peak_rss_bytes() -> int:
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
