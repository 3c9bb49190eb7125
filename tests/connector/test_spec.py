"""kv_store option parsing, and its validation in EngineConfig."""

from __future__ import annotations

import pytest

from kvmemo.config import EngineConfig
from kvmemo.connector.spec import DEFAULT_CAPACITY_BYTES, parse_kv_store


def test_parse_defaults_and_capacity():
    spec = parse_kv_store("disk:/data/kv")
    assert (spec.kind, spec.path, spec.capacity_bytes) == (
        "disk",
        "/data/kv",
        DEFAULT_CAPACITY_BYTES,
    )
    assert parse_kv_store("disk:/data/kv?capacity=20GiB").capacity_bytes == 20 * 2**30
    assert parse_kv_store("disk:rel/dir?capacity=512MiB").path == "rel/dir"
    assert spec.eviction == "lru"
    spec = parse_kv_store("disk:/d?capacity=1GiB&eviction=aged-arc")
    assert (spec.capacity_bytes, spec.eviction) == (2**30, "aged-arc")


def test_bad_eviction_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"eviction must be one of \['lru', 'aged-arc'\], got 'lfu'"):
        parse_kv_store("disk:/d?eviction=lfu")


@pytest.mark.parametrize(
    "spec",
    [
        "/data/kv",
        "redis:/x",
        "disk:",
        "disk:?capacity=1GiB",
        "disk:/x?capacity=lots",
        "disk:/x?capacity=0",
        "disk:/x?size=1GiB",
        "disk:/x?capacity",
        "disk:/x?capacity=-1GiB",
        "disk:/x?eviction=",
        "disk:/x?eviction=s3fifo",
    ],
)
def test_bad_spec_names_kv_store_and_the_form(spec):
    with pytest.raises(ValueError, match="kv_store") as info:
        parse_kv_store(spec)
    assert "disk:/path" in str(info.value)


def test_engine_config_validates_kv_store():
    assert EngineConfig(kv_store="disk:/tmp/x").kv_store == "disk:/tmp/x"
    with pytest.raises(ValueError, match="kv_store"):
        EngineConfig(kv_store="s3://bucket")
    with pytest.raises(ValueError, match="kv_store needs enable_prefix_caching"):
        EngineConfig(kv_store="disk:/tmp/x", enable_prefix_caching=False)


def test_cli_flag():
    from kvmemo.cli import build_parser, engine_options

    args = build_parser().parse_args(["generate", "hi", "--kv-store", "disk:/tmp/kv?capacity=1GiB"])
    assert engine_options(args)["kv_store"] == "disk:/tmp/kv?capacity=1GiB"
