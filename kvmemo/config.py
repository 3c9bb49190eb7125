"""Engine configuration: frozen dataclasses, validated at construction.

Invariant: a constructed EngineConfig is valid; unknown keys and bad values raise ValueError
naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvmemo.attention.names import ATTENTION_BACKENDS
from kvmemo.connector.admission import STORE_ADMISSIONS
from kvmemo.connector.spec import parse_kv_stores
from kvmemo.intake.segments import KV_REUSE_MODES
from kvmemo.kv.eviction import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES
from kvmemo.kv.hashing import HASH_ALGORITHMS
from kvmemo.spec.config import SpeculativeConfig
from kvmemo.units import parse_size_bytes

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
WEIGHT_MODES = ("auto", "dense", "native")
# The servers' step budget (`kvmemo serve`, `kvmemo ray-serve`), smaller than a batch job's: a
# step's length is every running stream's gap between tokens and every waiting request's wait
# for its first. Served prefix_repetition (64 prompts on 2 shared 1,024-token prefixes, Zen 4,
# 2 cores): 512 tokens a step gave a mean TTFT of 2.7 s bf16 and 4.5 s fp32 against 3.1 and
# 5.3 s at 2,048, in the same duration; 256 was slower in both. (vLLM likewise budgets its API
# server below its LLM class.)
SERVING_MAX_NUM_BATCHED_TOKENS = 512


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine instance.

    `EngineConfig.from_kwargs` rejects unknown keys.
    """

    model: str | None = None  # .gguf file or HF directory; None = the bundled SmolLM2 GGUF
    # Compute / weight dtype. auto: bfloat16 for dense weights where the hardware has bf16
    # products (avx512_bf16 or AMX, a bf16 GPU), else float32 ($KVMEMO_DTYPE overrides auto).
    # float32 with dense weights is the exact mode.
    dtype: str = "auto"
    # How a GGUF's weights are held: "dense" (dequantized to `dtype` at load: with float32, the
    # exact mode that matches transformers), "native" (at their GGUF bits over the memory-mapped
    # file, every product on int8 activations), or "auto": native for a GGUF on CPU, else dense
    # ($KVMEMO_WEIGHTS overrides auto)
    weights: str = "auto"
    device: str = "auto"  # auto = cuda when available, else cpu
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: str | int = "2GiB"  # KV pool size (ignored when num_blocks is set)
    num_blocks: int | None = None  # explicit KV pool size in blocks
    kv_cache_dtype: str = "auto"  # auto = the model dtype
    # Who writes K/V and attends: "paged" (the CPU kernels, torch elsewhere), "triton" (Triton
    # kernels: CUDA, or CPU under TRITON_INTERPRET=1), "reference" (slow, obviously correct), or
    # "auto": triton on CUDA when triton is installed, else paged
    attention_backend: str = "auto"
    # The paged backend attends each query row alone in one pass (True), so a request's tokens
    # and logprobs do not depend on its batch, its chunks or its cache hits; False lets it share
    # cascade prefixes, use flash prefill and split keys over threads: faster, with last-bit
    # differences between those cases (attention/invariant.py)
    batch_invariant: bool = True
    # Decode steps run layer by layer from Python: on CUDA instead of replaying CUDA graphs
    # captured per batch-size bucket (engine/cuda_graphs.py), as vLLM's enforce_eager; on the CPU
    # instead of one C call for the layers (engine/decode_chain.py). Same tokens either way.
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    enable_partial_reuse: bool = True  # copy the KV of a partially filled matching block
    prefix_cache_hash: str = "sha256"  # or xxh3_128: faster, unsafe where tenants share a cache
    enable_kv_events: bool = False  # collect BlockStored / BlockRemoved / AllBlocksCleared
    # Which free cached block goes first when the pool needs room (kv/eviction.py): "aged-arc"
    # (LRU's order until evicted-then-recomputed blocks show that reused ones deserve longer),
    # "lru", "arc" or "s3fifo"; chosen by replaying a production trace (docs/benchmarks.md)
    eviction_policy: str = DEFAULT_EVICTION_POLICY
    # Tokens of prompt prefixes one cache_salt may hold retained (Anthropic's cache_control
    # ttl, OpenAI's prompt_cache_retention; kv/retention.py); None: a quarter of the KV pool
    max_retained_tokens: int | None = None
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill beyond it)
    max_num_seqs: int = 64  # sequences in one step at most
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0  # seed of the sampler's default generator
    num_threads: int | None = None  # torch CPU threads; None = torch's default
    # persistent KV store(s): "disk:/path?capacity=20GiB", "redis://host:6379/0", or a list of
    # them (tiers, looked up in order, saved to all); None = off
    kv_store: str | tuple[str, ...] | None = None
    # Which committed blocks the store writes (connector/admission.py): "all", or "reused" (only
    # blocks seen twice: fewer bytes per hit for a store under pressure, fewer hits with room)
    kv_store_admission: str = "all"
    encoder_cache_memory: str | int = "256MiB"  # image features by content hash (LLaVA models)
    # A Jinja chat template (its text) replacing the model's own, as vLLM's --chat-template
    chat_template: str | None = None
    # Segmented prompts (context, chunks, question): "prefix" reuses exact prefixes only;
    # "blend" reuses each chunk's KV wherever it appears, recomputing a share of its tokens
    # (approximate; a request's kv_reuse overrides this). See docs/blending.md.
    kv_reuse: str = "prefix"
    blend_recompute_ratio: float = 0.15  # share of the reused tokens recomputed
    blend_check_layer: int = 1  # layer whose K/V deviation picks the tokens to recompute
    # Below this share of chunk tokens cached, a blend request runs as an exact prefill and its
    # chunks are computed after it (a blend would recompute more than it saves).
    blend_min_reuse: float = 0.5
    # LMCache's convention: a text prompt holding this string is split at it into segments
    # (the separator removed), e.g. " # # "; None: prompts are not split
    blend_separator: str | None = None
    # Speculative decoding (vLLM's speculative_config: {"method": "ngram" | "suffix",
    # "num_speculative_tokens": K, ...}, a dict, its JSON or a SpeculativeConfig); drafts are
    # verified losslessly, see docs/speculative.md. None: off
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            # Frozen: the parsed form replaces a dict or JSON text given by the caller.
            object.__setattr__(
                self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
            )
        _one_of("dtype", self.dtype, MODEL_DTYPES)
        _one_of("weights", self.weights, WEIGHT_MODES)
        _one_of("device", self.device, DEVICES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _one_of("prefix_cache_hash", self.prefix_cache_hash, HASH_ALGORITHMS)
        _one_of("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _one_of("kv_store_admission", self.kv_store_admission, STORE_ADMISSIONS)
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(
                f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size!r}"
            )
        parse_size_bytes(self.kv_cache_memory, "kv_cache_memory")
        parse_size_bytes(self.encoder_cache_memory, "encoder_cache_memory")
        _positive("num_blocks", self.num_blocks, allow_none=True)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_retained_tokens", self.max_retained_tokens, allow_none=True)
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("num_threads", self.num_threads, allow_none=True)
        _one_of("kv_reuse", self.kv_reuse, KV_REUSE_MODES)
        for name in ("blend_recompute_ratio", "blend_min_reuse"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0.0 <= value <= 1.0
            ):
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        if self.blend_separator is not None and (
            not isinstance(self.blend_separator, str) or not self.blend_separator
        ):
            raise ValueError(
                f"blend_separator must be a non-empty string or None, got {self.blend_separator!r}"
            )
        if isinstance(self.blend_check_layer, bool) or not isinstance(
            self.blend_check_layer, int
        ) or self.blend_check_layer < 0:
            raise ValueError(
                f"blend_check_layer must be an integer >= 0, got {self.blend_check_layer!r}"
            )
        if self.kv_store is not None:
            if isinstance(self.kv_store, list):
                # Frozen and hashable: tiers are a tuple. from_kwargs converts a list for callers.
                raise ValueError(
                    "kv_store must be a string or a tuple of strings (EngineConfig.from_kwargs "
                    f"also takes a list), got a list {self.kv_store!r}"
                )
            parse_kv_stores(self.kv_store)
            if not self.enable_prefix_caching:
                raise ValueError(
                    "kv_store needs enable_prefix_caching=True (blocks are saved when committed)"
                )

    @property
    def kv_cache_memory_bytes(self) -> int:
        return parse_size_bytes(self.kv_cache_memory, "kv_cache_memory")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {unknown}; allowed: {sorted(known)}"
            )
        if isinstance(kwargs.get("kv_store"), list):
            kwargs["kv_store"] = tuple(kwargs["kv_store"])
        return cls(**kwargs)



def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
