"""Our GGUF header parser reads exactly what gguf.GGUFReader reads (metadata, tensor infos, bytes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from kvmemo.model.loading.gguf_header import GGUFFile, parse_gguf_header
from kvmemo.model.loading.loader import bundled_model_path

V = GGUFValueType


def _flatten(value: Any) -> Any:
    """GGUFReader flattens nested arrays; we keep them nested."""
    if not isinstance(value, list):
        return value
    return [
        leaf for item in value for leaf in (_flatten(item) if isinstance(item, list) else [item])
    ]


def _assert_same_as_reader(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert list(ours.header.metadata) == list(theirs.fields)
    for key, field in theirs.fields.items():
        value = ours.header.metadata[key]
        assert _flatten(value) == field.contents(), key
        assert type(value) is type(field.contents()), key
    assert ours.header.data_offset == theirs.data_offset
    assert ours.header.alignment == theirs.alignment
    assert len(ours.header.tensors) == len(theirs.tensors)
    for info, tensor in zip(ours.header.tensors, theirs.tensors):
        assert (info.name, info.qtype) == (tensor.name, tensor.tensor_type)
        assert info.shape == tuple(reversed(tensor.shape.tolist()))
        assert (info.offset, info.n_bytes) == (tensor.data_offset, tensor.n_bytes)
        raw = np.asarray(tensor.data).view(np.uint8).reshape(info.byte_shape)
        assert np.array_equal(ours.raw(info), raw), info.name
    return ours


def test_tiny_file_with_every_value_type(tmp_path) -> None:
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)  # stored as float32: 0.10000000149011612
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ☃")
    writer.add_string("t.empty_str", "")
    writer.add_array("t.strs", ["a", "", "ünïcode", "x" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nested", [[1, 2], [3, 4, 5]])
    writer.add_array("t.nested_strs", [["a", "b"], ["c"]])
    writer.add_custom_alignment(64)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("f32", x)
    writer.add_tensor("f16", x[:3].astype(np.float16))
    writer.add_tensor(
        "q4_1", quants.quantize(x, GGMLQuantizationType.Q4_1), raw_dtype=GGMLQuantizationType.Q4_1
    )
    writer.add_tensor("vec", x[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = _assert_same_as_reader(path)
    meta = ours.header.metadata
    assert meta["t.nested"] == [[1, 2], [3, 4, 5]]
    assert meta["t.nested_strs"] == [["a", "b"], ["c"]]
    assert ours.header.alignment == 64 and ours.header.data_offset % 64 == 0
    assert [t.shape for t in ours.header.tensors] == [(4, 64), (3, 64), (4, 64), (64,)]

    short = parse_gguf_header(path.read_bytes(), max_array_len=3)
    assert "t.strs" not in short.metadata and "t.bools" in short.metadata
    assert short.tensors == ours.header.tensors  # skipping arrays keeps the offsets right


@pytest.mark.model
def test_bundled_smollm2_file() -> None:
    ours = _assert_same_as_reader(bundled_model_path())
    assert len(ours.header.metadata["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"GGML" + bytes(20), "magic"),
        (b"GGUF" + (1).to_bytes(4, "little") + bytes(16), "version 1"),
        (b"GGUF" + (3).to_bytes(4, "big") + bytes(16), "big-endian"),
        (
            b"GGUF"
            + (3).to_bytes(4, "little")
            + (0).to_bytes(8, "little")
            + (1).to_bytes(8, "little"),
            "malformed",
        ),
    ],
)
def test_bad_headers_are_value_errors(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_gguf_header(data)
