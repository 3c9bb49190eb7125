"""Engine configuration: frozen dataclasses, validated at construction.

Invariant: a constructed EngineConfig is valid; unknown keys and bad values raise ValueError
naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3")
MODEL_DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size_bytes(text: str | int, field_name: str) -> int:
    """'2GiB' -> 2147483648. Integers pass through. Raises ValueError naming the field."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"{field_name} must be a size such as '2GiB', '512MiB' or a byte count, got {text!r}"
            )
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"{field_name} must be > 0 bytes, got {text!r}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine instance. `EngineConfig.from_kwargs` rejects unknown keys."""

    model: str | None = None  # .gguf file or HF directory; None = the bundled SmolLM2 GGUF
    dtype: str = "float32"  # compute / weight dtype
    device: str = "auto"  # auto = cuda when available, else cpu
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: str | int = "2GiB"  # KV pool size (ignored when num_blocks is set)
    num_blocks: int | None = None  # explicit KV pool size in blocks
    kv_cache_dtype: str = "auto"  # auto = the model dtype
    enable_prefix_caching: bool = True
    enable_partial_reuse: bool = True  # copy the KV of a partially filled matching block
    prefix_cache_hash: str = "sha256"  # or xxh3_128: faster, unsafe where tenants share a cache
    enable_kv_events: bool = False  # collect BlockStored / BlockRemoved / AllBlocksCleared
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill beyond it)
    max_num_seqs: int = 64  # sequences in one step at most
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0  # seed of the sampler's default generator
    num_threads: int | None = None  # torch CPU threads; None = torch's default
    # persistent KV store(s): "disk:/path?capacity=20GiB", "redis://host:6379/0", or a list of
    # them (tiers, looked up in order, saved to all); None = off
    kv_store: str | tuple[str, ...] | None = None
    encoder_cache_memory: str | int = "256MiB"  # image features by content hash (LLaVA models)

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, MODEL_DTYPES)
        _one_of("device", self.device, DEVICES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("prefix_cache_hash", self.prefix_cache_hash, ("sha256", "xxh3_128"))
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size!r}")
        parse_size_bytes(self.kv_cache_memory, "kv_cache_memory")
        parse_size_bytes(self.encoder_cache_memory, "encoder_cache_memory")
        _positive("num_blocks", self.num_blocks, allow_none=True)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("num_threads", self.num_threads, allow_none=True)
        if self.kv_store is not None:
            from kvmemo.connector.spec import parse_kv_stores  # stdlib only; imports this module

            if isinstance(self.kv_store, list):  # frozen and hashable: keep tiers as a tuple
                object.__setattr__(self, "kv_store", tuple(self.kv_store))
            parse_kv_stores(self.kv_store)
            if not self.enable_prefix_caching:
                raise ValueError("kv_store needs enable_prefix_caching=True (blocks are saved when committed)")

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
        return cls(**kwargs)


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
