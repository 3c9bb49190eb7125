"""Block stores: the BlockStore protocol, the store namespace, and the on-disk block encoding.

Invariant: a payload comes back from a store only if its header matches this namespace, block
hash, dtype and shape and its sha256 matches; anything else is a miss. Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import logging
import re
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvmemo.kv.hashing import BlockHash

logger = logging.getLogger(__name__)

MAGIC = b"KVMB"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHH")  # magic, format version, header length (whole header, bytes)
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SHA256_BYTES = 32


@dataclass(frozen=True)
class StoreStats:
    """Cumulative counters of one store."""

    num_hits: int = 0  # blocks found and valid
    num_misses: int = 0  # blocks asked for and not found (or invalid)
    num_invalid: int = 0  # of the misses: files that failed validation (removed)
    bytes_read: int = 0  # payload bytes returned by get()
    bytes_written: int = 0  # encoded bytes written
    num_saves_dropped: int = 0  # put() calls dropped (queue full or saving paused)
    save_s: float = 0.0  # seconds spent encoding and writing (writer thread)
    num_evicted: int = 0  # blocks removed to stay under capacity


class StatsCounter:
    """Thread-safe cumulative StoreStats: the engine thread and a writer thread both count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = StoreStats()

    @property
    def stats(self) -> StoreStats:
        with self._lock:
            return self._stats

    def count(self, **deltas: float) -> None:
        with self._lock:
            self._stats = replace(
                self._stats, **{k: getattr(self._stats, k) + v for k, v in deltas.items()}
            )


class BlockStore(Protocol):
    """Where blocks live outside the device: raw KV payloads keyed by BlockHash.

    get() returns only validated payloads (or None); put() may be asynchronous and best-effort (a
    save can be dropped, never half-written); contains() is a hint for skipping duplicate saves.
    """

    kind: str  # the store spec's kind ("disk", "redis"): what stats and logs call it

    def get(self, block_hash: BlockHash) -> bytes | None: ...

    def get_many(self, block_hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """get() of each hash, in order (a remote store does it in one round trip); optional,
        see get_many() below."""
        ...

    def put(self, block_hash: BlockHash, payload: bytes) -> None: ...

    def contains(self, block_hash: BlockHash) -> bool: ...

    def flush(self) -> None: ...

    @property
    def stats(self) -> StoreStats: ...


def get_many(store: BlockStore, block_hashes: Sequence[BlockHash]) -> list[bytes | None]:
    """store.get_many(block_hashes), or a get() per hash for a store that has no get_many."""
    batched = getattr(store, "get_many", None)
    if batched is not None:
        return batched(block_hashes)
    return [store.get(h) for h in block_hashes]


_UNSAFE = re.compile(r"[^a-z0-9._-]+")


def sanitize_model_name(name: str) -> str:
    """A readable directory-name part: lower case, [a-z0-9._-] only, no leading dot, <= 64 chars."""
    cleaned = _UNSAFE.sub("-", name.lower()).strip("-.")[:64]
    return cleaned or "model"


@dataclass(frozen=True)
class StoreNamespace:
    """Everything that makes two blocks with one hash interchangeable, and its directory name.

    root_hash is the engine's namespace root (weights, KV dtype, block size, layout version), so
    two models never share a directory; dtype and block_shape describe the payload
    ([num_layers, 2, block_size, num_kv_heads, head_dim] raw bytes of `dtype`).
    """

    root_hash: bytes
    model_name: str
    dtype: str  # e.g. "float32", "bfloat16", "float8_e4m3fn" (fp8 stored as its raw bytes)
    block_shape: tuple[int, ...]
    itemsize: int  # bytes per element of dtype

    def __post_init__(self) -> None:
        if not self.root_hash:
            raise ValueError("root_hash must be non-empty bytes")
        if len(self.block_shape) != 5 or any(d <= 0 for d in self.block_shape):
            raise ValueError(
                "block_shape must be 5 positive ints [num_layers, 2, block_size, num_kv_heads, "
                f"head_dim], got {self.block_shape!r}"
            )
        if self.itemsize <= 0:
            raise ValueError(f"itemsize must be > 0, got {self.itemsize!r}")

    @property
    def dir_name(self) -> str:
        return f"{sanitize_model_name(self.model_name)}_{self.root_hash.hex()[:32]}"

    @property
    def payload_bytes(self) -> int:
        n = self.itemsize
        for d in self.block_shape:
            n *= d
        return n


def encode_block(namespace: StoreNamespace, block_hash: BlockHash, payload: bytes) -> bytes:
    """Header + payload. The header names the namespace, block, dtype, shape, length and sha256.

    Layout (little endian): magic "KVMB", u16 version, u16 header_len, then u8-length-prefixed
    root hash, block hash and dtype name, u8 ndim + u32 dims, u64 payload_len, 32-byte sha256.
    """
    if len(payload) != namespace.payload_bytes:
        raise ValueError(
            f"payload must be {namespace.payload_bytes} bytes for shape {namespace.block_shape} "
            f"{namespace.dtype}, got {len(payload)}"
        )
    body = bytearray()
    for part in (namespace.root_hash, bytes(block_hash), namespace.dtype.encode("ascii")):
        body += _U8.pack(len(part)) + part
    body += _U8.pack(len(namespace.block_shape))
    for d in namespace.block_shape:
        body += _U32.pack(d)
    body += _U64.pack(len(payload)) + hashlib.sha256(payload).digest()
    header = _FIXED.pack(MAGIC, FORMAT_VERSION, _FIXED.size + len(body)) + bytes(body)
    return header + payload


class InvalidBlock(Exception):
    """Raised by decode_block_checked: the reason a stored block is not usable."""


def decode_block(
    namespace: StoreNamespace, block_hash: BlockHash, data: bytes | memoryview
) -> bytes | None:
    """The payload of an encoded block, or None (logged warning) if anything does not match."""
    try:
        return decode_block_checked(namespace, block_hash, data)
    except InvalidBlock as exc:
        logger.warning(
            "KV store: block %s is invalid (%s); treating it as a miss",
            bytes(block_hash).hex()[:16],
            exc,
        )
        return None


def decode_block_checked(
    namespace: StoreNamespace, block_hash: BlockHash, data: bytes | memoryview
) -> bytes:
    """Like decode_block, but raises InvalidBlock with the reason instead of returning None."""
    view = memoryview(data)
    try:
        magic, version, header_len = _FIXED.unpack_from(view, 0)
        if magic != MAGIC:
            raise InvalidBlock(f"bad magic {bytes(magic)!r}")
        if version != FORMAT_VERSION:
            raise InvalidBlock(f"format version {version}, expected {FORMAT_VERSION}")
        pos = _FIXED.size
        fields: list[bytes] = []
        for _ in range(3):
            (n,) = _U8.unpack_from(view, pos)
            fields.append(bytes(view[pos + 1 : pos + 1 + n]))
            pos += 1 + n
        root, stored_hash, dtype = fields
        (ndim,) = _U8.unpack_from(view, pos)
        pos += 1
        shape = tuple(_U32.unpack_from(view, pos + 4 * i)[0] for i in range(ndim))
        pos += 4 * ndim
        (payload_len,) = _U64.unpack_from(view, pos)
        pos += 8
        checksum = bytes(view[pos : pos + _SHA256_BYTES])
        pos += _SHA256_BYTES
    except struct.error as exc:
        raise InvalidBlock(f"truncated header ({len(view)} bytes)") from exc
    if pos != header_len:
        raise InvalidBlock(f"header length {header_len} does not match its fields ({pos})")
    if root != namespace.root_hash:
        raise InvalidBlock("written under another namespace")
    if stored_hash != bytes(block_hash):
        raise InvalidBlock("header names another block hash")
    if dtype.decode("ascii", "replace") != namespace.dtype:
        raise InvalidBlock(f"dtype {dtype!r}, expected {namespace.dtype!r}")
    if shape != tuple(namespace.block_shape):
        raise InvalidBlock(f"shape {shape}, expected {tuple(namespace.block_shape)}")
    if payload_len != namespace.payload_bytes or len(view) - pos != payload_len:
        raise InvalidBlock(
            f"payload is {len(view) - pos} bytes, header says {payload_len}, "
            f"expected {namespace.payload_bytes}"
        )
    payload = view[pos:]
    if hashlib.sha256(payload).digest() != checksum:
        raise InvalidBlock("sha256 mismatch")
    return bytes(payload)
