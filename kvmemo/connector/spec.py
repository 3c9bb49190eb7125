"""The kv_store option: "disk:/path?capacity=20GiB" or "redis://host:6379/0?timeout=0.5", one
string or a list of them (tiers, looked up in the order given), parsed into KVStoreSpecs.

Invariant: parsing either returns complete specs or raises ValueError naming kv_store and the
allowed forms; no filesystem or network access happens here.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from kvmemo.kv.keyed_eviction import KEYED_POLICIES
from kvmemo.units import parse_size_bytes

DEFAULT_CAPACITY_BYTES = 10 * 2**30
DEFAULT_REDIS_TIMEOUT_S = 0.5
_FORM = ("'disk:/path', 'disk:/path?capacity=20GiB&eviction=aged-arc' or "
         "'redis://host:6379/0?timeout=0.5'")
_REDIS_SCHEMES = ("redis", "rediss")


@dataclass(frozen=True)
class KVStoreSpec:
    kind: str  # "disk" or "redis"
    path: str  # disk: the store's root directory; redis: the server URL without our options
    capacity_bytes: int | None = None  # disk: per namespace directory; redis: None (maxmemory)
    timeout_s: float | None = None  # redis: socket connect/read timeout; disk: None
    eviction: str = "lru"  # disk: KEYED_POLICIES; redis: the server's maxmemory-policy decides


def parse_kv_stores(value: str | list[str] | tuple[str, ...]) -> tuple[KVStoreSpec, ...]:
    """One spec string, or a non-empty list of them (tiers, fastest first), -> specs in order.

    Raises ValueError for an empty list, a non-string item, a bad item, or the same store twice.
    """
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(
            f"kv_store must be a string or a non-empty list of strings ({_FORM}), got {value!r}"
        )
    specs = tuple(parse_kv_store(item) for item in items)
    seen: set[tuple[str, str]] = set()
    for spec in specs:
        if (spec.kind, spec.path) in seen:
            raise ValueError(f"kv_store lists the store {spec.kind}:{spec.path} twice")
        seen.add((spec.kind, spec.path))
    return specs


def parse_kv_store(spec: str) -> KVStoreSpec:
    """'disk:/data/kv?capacity=20GiB' -> KVStoreSpec("disk", "/data/kv", 20 GiB);
    'redis://h:6379/0?timeout=0.2' -> KVStoreSpec("redis", "redis://h:6379/0", None, 0.2).

    capacity is optional (default 10GiB) and takes the sizes kv_cache_memory takes; eviction is
    optional (default lru; aged-arc is the pool's default policy in its keyed form, which gains
    where the directory is small beside the traffic and its pool, and loses where it holds less
    than about twice a large pool: docs/connector.md); timeout is optional (default 0.5 s), the
    longest one Redis call may hold the engine thread.
    """
    if not isinstance(spec, str):
        raise ValueError(f"kv_store must be a string of the form {_FORM}, got {spec!r}")
    kind, sep, rest = spec.partition(":")
    if sep and kind in _REDIS_SCHEMES:
        return _parse_redis(spec)
    if not sep or kind != "disk":
        raise ValueError(
            f"kv_store must be of the form {_FORM} (kind 'disk' or 'redis'), got {spec!r}"
        )
    path, _, query = rest.partition("?")
    if not path:
        raise ValueError(f"kv_store needs a directory path, of the form {_FORM}, got {spec!r}")
    capacity_bytes = DEFAULT_CAPACITY_BYTES
    eviction = "lru"
    for key, value in _options(spec, query):
        if key == "capacity":
            capacity_bytes = _size(value)
        elif key == "eviction":
            if value not in KEYED_POLICIES:
                raise ValueError(f"kv_store disk eviction must be one of {list(KEYED_POLICIES)}, "
                                 f"got {value!r} ({_FORM})")
            eviction = value
        else:
            raise ValueError(f"kv_store option {key!r} is unknown for disk; allowed: capacity, "
                             f"eviction ({_FORM})")
    return KVStoreSpec(kind=kind, path=path, capacity_bytes=capacity_bytes, eviction=eviction)


def _parse_redis(spec: str) -> KVStoreSpec:
    base, _, query = spec.partition("?")
    parts = urlsplit(base)
    if not parts.hostname or not (parts.path in ("", "/") or parts.path.strip("/").isdigit()):
        raise ValueError(
            f"kv_store redis URL must look like redis://host:6379/0 ({_FORM}), got {spec!r}"
        )
    try:
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        raise ValueError(f"kv_store redis URL has a bad port ({_FORM}), got {spec!r}") from None
    timeout_s = DEFAULT_REDIS_TIMEOUT_S
    for key, value in _options(spec, query):
        if key != "timeout":
            raise ValueError(
                f"kv_store option {key!r} is unknown for redis; allowed: timeout ({_FORM})"
            )
        message = f"kv_store redis timeout must be seconds in (0, 60], got {value!r} ({_FORM})"
        try:
            timeout_s = float(value)
        except ValueError:
            raise ValueError(message) from None
        if not 0.0 < timeout_s <= 60.0:
            raise ValueError(message)
    return KVStoreSpec(kind="redis", path=base, timeout_s=timeout_s)


def _options(spec: str, query: str) -> list[tuple[str, str]]:
    try:
        return parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(
            f"kv_store options must look like ?capacity=20GiB or ?timeout=0.5 ({_FORM}), "
            f"got {spec!r}"
        ) from None


def _size(value: str) -> int:
    try:
        return parse_size_bytes(value, "kv_store capacity")
    except ValueError as exc:
        raise ValueError(f"{exc} (kv_store form: {_FORM})") from None
