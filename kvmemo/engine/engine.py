"""Engine: schedule -> execute -> update -> process outputs, one step at a time, over the parts
build_engine (builder.py) wired together: kv/, model/ and attention/ meet nowhere else.

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

from kvmemo.config import EngineConfig
from kvmemo.engine.beam_search import BeamSearchParams
from kvmemo.engine.blend_driver import check_blend_supported
from kvmemo.engine.builder import build_engine
from kvmemo.engine.stats import EngineStats, KVInfo, MemoryStats, collect_stats
from kvmemo.errors import InputError
from kvmemo.intake.processor import ProcessedPrompt
from kvmemo.kv.events import KVEvent
from kvmemo.kv.hashing import BlockHash
from kvmemo.kv.retention import Retention
from kvmemo.outputs import RequestOutput
from kvmemo.request import Request, RequestStatus
from kvmemo.sampling import SamplingParams
from kvmemo.structured.grammar import StructuredOutputCompiler

logger = logging.getLogger(__name__)


class Engine:
    """Owns the model runner, the scheduler, the KV cache manager and the beam search driver."""

    def __init__(self, config: EngineConfig):
        parts = build_engine(config)  # engine/builder.py: every part, wired
        self.config = config
        self.device = parts.device
        self.loaded = parts.loaded  # the model, its config, tokenizer and weights fingerprint
        self.weights_fingerprint = parts.loaded.weights_fingerprint
        self.tokenizer = parts.loaded.tokenizer
        self.linear_kernels = parts.linear_kernels
        self.processor = parts.processor
        self.max_model_len = parts.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        self.layout = parts.layout
        self.hasher = parts.hasher
        self.kv_manager = parts.kv_manager
        self.kv_connector = parts.kv_connector
        self.scheduler = parts.scheduler
        self.beams = parts.beams
        self.blends = parts.blends
        self.runner = parts.runner
        self.outputs = parts.outputs
        self.drafts = parts.drafts  # speculative decoding's DraftProposer, or None
        self._kv_event_subscribers: list[Callable[[list[KVEvent]], None]] = []
        self._structured: StructuredOutputCompiler | None = None
        self.num_steps = 0

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        retention: tuple[Retention, ...] = (),
        priority: int = 0,
    ) -> None:
        """Validate and queue one sequence (params.n must be 1: see add_requests).

        retention: prompt prefixes kept cached after the request ends (kv/retention.py);
        InputError (param "retention") if they would take the cache_salt past its quota.
        Blended requests ignore it. priority: vLLM's (lower is more important); above 0, the
        blocks only this request used go first when the pool needs room."""
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
            request.retention = tuple(retention)
            request.priority = priority
            self.kv_manager.check_retention(request)
            self.scheduler.add_request(request)
        self.outputs.add(request, blended=blended)

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
        retention: tuple[Retention, ...] = (),
        priority: int = 0,
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
                    self.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                     retention=retention, priority=priority)
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
        self.outputs.add(root, beam_search=search)

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
        self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission: the queue depth."""
        return len(self.scheduler.waiting)

    # ---- the loop --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step: schedule -> execute -> update -> process outputs (-> the next drafts,
        with speculative decoding on). Returns an output for every request that got tokens or
        finished (as its output kind allows)."""
        output = self.scheduler.schedule()
        result = self.runner.execute(output)
        self.num_steps += 1
        sampled = {rid: [t.token_id for t in tokens] for rid, tokens in result.sampled.items()}
        touched = self.scheduler.update_from_output(output, sampled)
        for request_id, reused in result.blend_counts.items():
            state = self.outputs.get(request_id)
            spec = state.request.blend if state is not None else None
            if spec is not None:
                spec.num_reused_tokens = reused
        if self.blends.is_driving:
            # Chunk sequences are the blend driver's: their tokens are never shown (sorted out
            # first: the driver forgets a chunk once its blend moves on).
            chunks = [r for r in touched if self.blends.is_chunk(r.request_id)]
            touched = [r for r in touched if not self.blends.is_chunk(r.request_id)]
            self.blends.after_step(chunks + touched)
        self.outputs.record_prompt_logprobs(result.prompt_logprobs)
        ended = (
            self.beams.after_step(result.logprobs_rows, output.preempted_request_ids)
            if self.beams.searches
            else []
        )
        self._publish_kv_events()
        outputs = self.outputs.process(touched, result.sampled, ended, time.monotonic())
        if self.drafts is not None:
            # After the outputs: a stop string there may have ended a request.
            decoding = sum(1 for request in touched if not request.is_finished)
            for request in touched:
                if request.is_finished:
                    self.drafts.finished(request)
                else:
                    request.draft_token_ids = self.drafts.propose(request, decoding)
        return outputs

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
        if self.kv_connector is not None:  # even without events: device hits may be written
            lookup = self.kv_manager.cached_block_ids
            saves = self.kv_connector.blocks_to_save(events, lookup)
            if saves:
                self.kv_connector.save_blocks(saves)
        if self.config.enable_kv_events and events:
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
