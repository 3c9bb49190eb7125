"""BlendDriver: position-independent chunk caching for segmented prompts (kv_reuse="blend").

A segmented prompt is [context, chunk_1, ..., chunk_k, question] (kvmemo/intake/segments.py).

The chunk cache is prefix caching of [context + chunk] sequences under a "chunk" marker: each
chunk's KV is computed after the context alone, at the positions right after it, and its blocks
from the one holding the chunk's first token on are hashed with ("reuse", "chunk") (see
Request.kv_marker). The sequence is padded past its last block boundary, so every chunk token
lies in a full block. So chunk KV lives in the same block pool and LRU, is saved to and loaded from
the disk and Redis stores like any block, is isolated by cache_salt and model like any chain, and
never serves an exact-prefix lookup. The context's own blocks stay exact and shared.

A blend request runs in two phases, driven from here, between engine steps:
1. Its chunk sequences not all in the pool go through the scheduler as ordinary one-token
   requests (loaded where a store has them, computed where not); their outputs are dropped.
2. Then the prompt itself is queued with a BlendSpec: the scheduler holds the chunks' blocks and
   schedules the whole prompt in one step; the runner copies their KV in at the new positions and
   recomputes the tokens picked on the check layer (blend_forward.py). Its blocks after the
   context carry a "blend" marker: approximate KV is reused only by the same blend.

When too little of the chunks is cached (blend_min_reuse), blending would compute more than a
plain prefill: the request then runs as an exact prefill, and its chunks are computed after its
first token, ready for the next prompt that uses them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvmemo.connector.base import KVConnector
from kvmemo.engine.scheduler import Scheduler
from kvmemo.errors import InputError
from kvmemo.kv.hybrid import AnyKVCacheManager
from kvmemo.request import BlendSpec, Request, RequestStatus
from kvmemo.sampling import SamplingParams

CHUNK_MARKER = "chunk"
_CHUNK_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def blend_marker(recompute_ratio: float, check_layer: int) -> str:
    """The marker of a blended prompt's blocks: its KV depends on the ratio and check layer."""
    return f"blend/{recompute_ratio!r}/{check_layer}"


@dataclass
class _Blend:
    """One blend request between its arrival and its prompt's admission."""

    request: Request
    chunks: list[Request]
    warm_after_first_token: bool  # cold: the request runs exact, chunks computed after it
    waiting_on: set[str] = field(default_factory=set)  # chunk ids not finished yet


@dataclass(frozen=True)
class BlendSettings:
    recompute_ratio: float
    check_layer: int
    min_reuse: float


class BlendDriver:
    """Owns the chunk sequences of blend requests and the requests waiting for them."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv: AnyKVCacheManager,
        connector: KVConnector | None,
        settings: BlendSettings,
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.connector = connector
        self.settings = settings
        self._blends: dict[str, _Blend] = {}  # by the blend request's id
        self._chunk_owner: dict[str, str] = {}  # chunk request id -> blend request id

    def is_chunk(self, request_id: str) -> bool:
        return request_id in self._chunk_owner

    @property
    def is_driving(self) -> bool:
        """True while a blend waits on its chunks (or a cold one on its first token): only then
        has a step's outcome anything for the driver."""
        return bool(self._blends)

    def add(
        self,
        ranges: list[tuple[int, int]],
        recompute_ratio: float | None,
        new_request: Callable[..., Request],
        request_id: str,
        prompt_token_ids: list[int],
    ) -> Request:
        """Queues a blend request (its chunks first, or after it when cold) and returns it.

        ranges: [start, end) of every segment. new_request(request_id, token_ids, kv_marker,
        params) builds a request with the caller's params and salt (params None).
        """
        context_len = ranges[0][1]
        chunk_ranges = ranges[1:-1]
        ratio = self.settings.recompute_ratio if recompute_ratio is None else recompute_ratio
        check_layer = self.settings.check_layer
        size = self.kv.block_size
        chunks = [
            new_request(
                f"{request_id}\x00chunk{i}",
                _padded(prompt_token_ids[:context_len] + prompt_token_ids[start:end], size),
                (context_len, CHUNK_MARKER),
                _CHUNK_PARAMS,
            )
            for i, (start, end) in enumerate(chunk_ranges)
        ]
        chunk_tokens = sum(end - start for start, end in chunk_ranges)
        hits = [self._cached_chunk_tokens(c, context_len) for c in chunks]
        cold = sum(total for _, total in hits) < self.settings.min_reuse * chunk_tokens
        if cold:
            request = new_request(request_id, prompt_token_ids, None, None)
        else:
            request = new_request(
                request_id, prompt_token_ids, (context_len, blend_marker(ratio, check_layer)), None
            )
            request.blend = BlendSpec(context_len, chunk_ranges, chunks, ratio, check_layer)
        self.scheduler.check_fits(request)
        # A chunk whose full blocks are all in the pool needs no step of its own: the blend
        # holds them at admission.
        to_compute = [
            chunk
            for chunk, (device, _) in zip(chunks, hits)
            if context_len + device < (chunk.num_tokens - 1) // size * size
        ]
        if cold:
            to_compute = chunks
        elif not to_compute:  # every chunk is in the pool: the prompt blends now
            self.scheduler.add_request(request)
            return request
        blend = _Blend(request, to_compute, cold)
        self._blends[request_id] = blend
        for chunk in to_compute:
            self._chunk_owner[chunk.request_id] = request_id
        if cold:
            self.scheduler.add_request(request)
        else:
            self._queue_chunks(blend)
        return request

    def _queue_chunks(self, blend: _Blend) -> None:
        for chunk in blend.chunks:
            self.scheduler.add_request(chunk)
            blend.waiting_on.add(chunk.request_id)

    def _cached_chunk_tokens(self, chunk: Request, context_len: int) -> tuple[int, int]:
        """Chunk tokens whose KV the pool holds now, and the pool or a store (estimates: both
        may change before the chunk is scheduled)."""
        device = self.kv.get_computed_blocks(chunk).num_tokens
        hit = device
        if self.connector is not None:
            size = self.kv.block_size
            stored = self.connector.count_stored_tokens(chunk, device)
            hit = max(device, device // size * size + stored)
        return max(0, device - context_len), max(0, hit - context_len)

    def after_step(self, touched: Iterable[Request]) -> None:
        """Advances blends past this step: finished chunks let their prompt in; a cold
        request's first token lets its chunks in."""
        for request in touched:
            owner = self._chunk_owner.get(request.request_id)
            if owner is not None:
                if request.is_finished:
                    self._chunk_finished(request, owner)
                continue
            blend = self._blends.get(request.request_id)
            if blend is not None and blend.warm_after_first_token:
                blend.warm_after_first_token = False
                self._queue_chunks(blend)

    def _chunk_finished(self, chunk: Request, owner: str) -> None:
        blend = self._blends[owner]
        blend.waiting_on.discard(chunk.request_id)
        if blend.waiting_on:
            return
        self._forget(owner)
        if blend.request.blend is not None:  # warm: the prompt now blends with its chunks
            self.scheduler.add_request(blend.request)

    def _forget(self, request_id: str) -> None:
        blend = self._blends.pop(request_id, None)
        if blend is None:
            return
        for chunk in blend.chunks:
            self._chunk_owner.pop(chunk.request_id, None)

    def abort(self, request_id: str) -> None:
        """Drops a blend request's unfinished chunk sequences (the request itself is the
        scheduler's to finish)."""
        blend = self._blends.pop(request_id, None)
        if blend is None:
            return
        for chunk in blend.chunks:
            self._chunk_owner.pop(chunk.request_id, None)
            if not chunk.is_finished:
                self.scheduler.finish_request(chunk.request_id, RequestStatus.FINISHED_ABORTED)


def _padded(token_ids: list[int], block_size: int) -> list[int]:
    """The chunk sequence padded (with its last token) to one token past a block boundary.

    Tokens after the chunk cannot change its KV (attention is causal), and so every chunk token
    sits in a full block, which gets a hash and is cached, saved and loaded whole; only the one
    pad token after the boundary is ever recomputed (a prefill always computes its last token).
    """
    pad = (-len(token_ids)) % block_size + 1
    return token_ids + [token_ids[-1]] * pad


def check_blend_supported(
    *,
    has_layers: bool,
    is_hybrid: bool,
    is_fp8: bool,
    has_images: bool,
    wants_prompt_logprobs: bool,
) -> None:
    """Raises InputError naming why this engine or request cannot blend."""
    reasons = [
        (not has_layers, "the model is not a Llama-family decoder"),
        (is_hybrid, "the model has sliding-window layers"),
        (is_fp8, "the KV cache is fp8 (blending needs bf16 or fp32 KV)"),
        (has_images, "the prompt has images"),
        (wants_prompt_logprobs, "prompt_logprobs needs every prompt position computed"),
    ]
    for failed, why in reasons:
        if failed:
            raise InputError("kv_reuse", f"kv_reuse='blend' is not available here: {why}")
