"""The kv_store option: "disk:/path?capacity=20GiB" parsed into a KVStoreSpec.

Invariant: parse_kv_store either returns a complete spec or raises ValueError naming kv_store and
the allowed form; no filesystem access happens here.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl

DEFAULT_CAPACITY_BYTES = 10 * 2**30
_FORM = "'disk:/path' or 'disk:/path?capacity=20GiB'"


@dataclass(frozen=True)
class KVStoreSpec:
    kind: str  # "disk" (the only kind so far)
    path: str  # the store's root directory
    capacity_bytes: int  # per namespace directory


def parse_kv_store(spec: str) -> KVStoreSpec:
    """'disk:/data/kv?capacity=20GiB' -> KVStoreSpec("disk", "/data/kv", 20 GiB).

    capacity is optional (default 10GiB) and takes the sizes kv_cache_memory takes.
    """
    from kvmemo.config import parse_size_bytes  # config imports this module lazily

    if not isinstance(spec, str):
        raise ValueError(f"kv_store must be a string of the form {_FORM}, got {spec!r}")  # noqa: TRY004
    kind, sep, rest = spec.partition(":")
    if not sep or kind != "disk":
        raise ValueError(f"kv_store must be of the form {_FORM} (kind 'disk'), got {spec!r}")
    path, _, query = rest.partition("?")
    if not path:
        raise ValueError(f"kv_store needs a directory path, of the form {_FORM}, got {spec!r}")
    capacity_bytes = DEFAULT_CAPACITY_BYTES
    try:
        options = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(
            f"kv_store options must look like ?capacity=20GiB ({_FORM}), got {spec!r}"
        ) from None
    for key, value in options:
        if key != "capacity":
            raise ValueError(f"kv_store option {key!r} is unknown; allowed: capacity ({_FORM})")
        try:
            capacity_bytes = parse_size_bytes(value, "kv_store capacity")
        except ValueError as exc:
            raise ValueError(f"{exc} (kv_store form: {_FORM})") from None
    return KVStoreSpec(kind=kind, path=path, capacity_bytes=capacity_bytes)
