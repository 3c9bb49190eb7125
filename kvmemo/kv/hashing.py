"""Block hashing: hash_i = H(hash_{i-1}, token_ids_i, extra_keys_i), chained from a namespace root.

Invariant: equal hashes only for equal (root, tokens, extra keys) chains; each block hashed once.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType, Protocol

from kvmemo.kv.mm_items import MultiModalItem, overlapping_items

BlockHash = NewType("BlockHash", bytes)


class HashedSequence(Protocol):
    """What hashing reads of a sequence (a Request): its tokens, the hashes of its full blocks
    so far (extended in place), its multimodal items, salt and reuse marker."""

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def block_hashes(self) -> list[BlockHash]: ...

    @property
    def mm_items(self) -> Sequence[MultiModalItem]: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def kv_marker(self) -> tuple[int, str] | None: ...

# sha256: collision resistant, the default. xxh3_128: several times faster but NOT collision
# resistant: a tenant can craft a prompt whose block collides with another tenant's, so use it only
# where a single trusted party fills the cache (the manager still verifies tokens on every hit).
HASH_ALGORITHMS = ("sha256", "xxh3_128")

# Bump when the KV page layout changes, so blocks written by an older layout never match.
LAYOUT_VERSION = 1

# One extra key: (mm content hash, block start - item offset), ("salt", salt) or
# ("reuse", marker name).
ExtraKey = tuple[bytes, int] | tuple[str, str]
ExtraKeys = tuple[ExtraKey, ...]

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_NO_KEYS = b"t" + _U32.pack(0)  # _encode(()): most blocks have no extra keys


def check_algorithm(algorithm: str) -> None:
    """Raises ValueError unless `algorithm` is one of HASH_ALGORITHMS."""
    if algorithm not in HASH_ALGORITHMS:
        raise ValueError(f"hash algorithm must be one of {HASH_ALGORITHMS}, got {algorithm!r}")


def _digest(data: bytes, algorithm: str) -> BlockHash:
    if algorithm == "sha256":
        return BlockHash(hashlib.sha256(data).digest())
    check_algorithm(algorithm)
    try:
        import xxhash
    except ImportError as exc:  # optional dependency
        raise ValueError("hash algorithm 'xxh3_128' needs the xxhash package") from exc
    return BlockHash(xxhash.xxh3_128_digest(data))


def _encode(value: object, out: bytearray) -> None:
    """Appends a canonical, type-tagged, length-prefixed encoding of `value` to `out`."""
    if isinstance(value, bool):  # before int: bool is an int subclass
        out += b"?\x01" if value else b"?\x00"
    elif isinstance(value, int):
        out += b"i" + _I64.pack(value)
    elif isinstance(value, bytes):
        out += b"b" + _U32.pack(len(value)) + value
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"s" + _U32.pack(len(raw)) + raw
    elif value is None:
        out += b"n"
    elif isinstance(value, tuple):
        out += b"t" + _U32.pack(len(value))
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} in a block hash key")


def namespace_root_hash(
    *,
    weights_fingerprint: str,
    kv_cache_dtype: str,
    block_size: int,
    layout_version: int = LAYOUT_VERSION,
    algorithm: str = "sha256",
) -> BlockHash:
    """The parent hash of every chain's first block: a digest of all that changes KV content.

    Deterministic across processes (no seed), so blocks can be shared on disk and across machines.
    """
    check_algorithm(algorithm)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    out = bytearray(b"kvmemo-namespace")
    _encode((weights_fingerprint, kv_cache_dtype, block_size, layout_version, algorithm), out)
    return _digest(bytes(out), algorithm)


def hash_block(
    parent: BlockHash,
    token_ids: Sequence[int],
    extra_keys: tuple,
    algorithm: str = "sha256",
    token_bytes: bytes | None = None,
) -> BlockHash:
    """Hash of one full block, chained through its parent's hash.

    Encoding: len(parent) | parent | num_tokens | token ids as int64 LE | type-tagged extra keys.
    token_bytes: the token ids already packed so (a caller hashing many blocks packs them at
    once).
    """
    if token_bytes is None:
        token_bytes = struct.pack(f"<{len(token_ids)}q", *token_ids)
    keys: bytes | bytearray = _NO_KEYS
    if extra_keys:
        keys = bytearray()
        _encode(tuple(extra_keys), keys)
    return _digest(b"".join((_U32.pack(len(parent)), parent, _U32.pack(len(token_ids)),
                             token_bytes, keys)), algorithm)


def extra_keys_for_range(request: HashedSequence, start: int, end: int) -> ExtraKeys:
    """Extra keys of the token range [start, end) of `request`, in the order DESIGN.md fixes."""
    return _extra_keys(request.mm_items, request.cache_salt, start, end, request.kv_marker)


def _extra_keys(
    items: Sequence[MultiModalItem],
    cache_salt: str | None,
    start: int,
    end: int,
    marker: tuple[int, str] | None = None,
) -> ExtraKeys:
    """Multimodal items overlapping [start, end) give (content_hash, start - item.offset); then
    ("salt", cache_salt) only for a range starting at 0; then ("reuse", name) for the range
    holding the marker's token (Request.kv_marker). Needs items sorted by offset and
    non-overlapping (checked before the first block is hashed); a bisect on the item ends keeps
    this O(log items + items overlapping).
    """
    keys: list[ExtraKey] = []
    if items:
        for i in overlapping_items(items, start, end):
            keys.append((items[i].content_hash, start - items[i].offset))
    if start == 0 and cache_salt is not None:
        keys.append(("salt", cache_salt))
    if marker is not None and start <= marker[0] < end:
        keys.append(("reuse", marker[1]))
    return tuple(keys)


def _check_mm_items(items: Sequence[MultiModalItem]) -> None:
    prev_end = 0
    for index, item in enumerate(items):
        if item.length < 1 or item.offset < prev_end:
            raise ValueError(
                f"mm_items must be sorted by offset, non-overlapping and of length >= 1; "
                f"item {index} has offset {item.offset} and length {item.length}"
            )
        prev_end = item.offset + item.length


class RequestHasher:
    """Extends request.block_hashes as blocks fill; holds the namespace root and the algorithm.

    Promises: every full block of a request is hashed exactly once (counted in num_hashed_blocks).
    """

    def __init__(self, root: BlockHash, block_size: int, algorithm: str = "sha256") -> None:
        check_algorithm(algorithm)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.root = root
        self.block_size = block_size
        self.algorithm = algorithm
        self.num_hashed_blocks = 0  # hash computations so far, for tests and metrics

    def extend(self, request: HashedSequence) -> None:
        """Appends the hash of every newly full block of request.all_token_ids.

        Called by the Request itself (Request.extend_block_hashes), whenever its tokens grow.
        Side effect: mutates request.block_hashes; resumes at len(request.block_hashes).
        Raises ValueError if request.mm_items is unsorted or overlapping (checked on first call).
        """
        self._chain(
            request.block_hashes, request.all_token_ids, request.mm_items, request.cache_salt,
            request.kv_marker,
        )

    def hash_prompt(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        kv_marker: tuple[int, str] | None = None,
    ) -> list[BlockHash]:
        """The hashes of a prompt's full blocks, as a request of this engine would get them
        (the router predicts a replica's hits with this)."""
        hashes: list[BlockHash] = []
        self._chain(hashes, token_ids, mm_items, cache_salt, kv_marker)
        return hashes

    def _chain(
        self,
        hashes: list[BlockHash],
        tokens: Sequence[int],
        mm_items: Sequence[MultiModalItem],
        cache_salt: str | None,
        kv_marker: tuple[int, str] | None = None,
    ) -> None:
        size = self.block_size
        if not hashes and mm_items:
            _check_mm_items(mm_items)
        parent = hashes[-1] if hashes else self.root
        first, end = len(hashes), len(tokens) // size
        if first >= end:
            return
        # Every block's token ids packed in one call (a cached 8,000-token prompt's 500 blocks
        # took 8 ms of its time to first token one struct.pack at a time); the bytes hashed
        # are hash_block's either way.
        packed = struct.pack(f"<{(end - first) * size}q", *tokens[first * size : end * size])
        for index in range(first, end):
            start = index * size
            keys = _extra_keys(mm_items, cache_salt, start, start + size, kv_marker)
            offset = (index - first) * size * 8
            parent = hash_block(parent, tokens[start : start + size], keys, self.algorithm,
                                packed[offset : offset + size * 8])
            hashes.append(parent)
            self.num_hashed_blocks += 1

    def extra_keys(self, request: HashedSequence, block_index: int) -> ExtraKeys:
        """Extra keys of full block `block_index` of `request`."""
        start = block_index * self.block_size
        return extra_keys_for_range(request, start, start + self.block_size)

    def parent_hash(self, request: HashedSequence, block_index: int) -> BlockHash:
        """Hash of the block before `block_index` (the root for block 0); needs it extended."""
        return self.root if block_index == 0 else request.block_hashes[block_index - 1]
