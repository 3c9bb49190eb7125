"""GGUF header parser: metadata key/values and tensor infos, straight from the file's bytes.

GGUF v2/v3 layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 kv count;
kv pairs (string key, u32 value type, value; arrays are u32 item type, u64 count, items; strings
are u64 length + UTF-8 bytes); tensor infos (string name, u32 n_dims, u64 dims (innermost first),
u32 ggml type, u64 offset); then the data section, aligned to `general.alignment` (default 32).

Invariant: metadata values and tensor infos equal gguf.GGUFReader's (`field.contents()`,
ReaderTensor name/type/shape/offset/bytes), except that nested arrays stay nested where
GGUFReader flattens them. Unlike GGUFReader this never creates a numpy view per header item,
so parsing a 49k-token vocabulary costs milliseconds, not seconds.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

V = GGUFValueType
# Fixed-size value types: (struct format, numpy dtype) for one item.
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, str]] = {
    V.UINT8: (struct.Struct("<B"), "<u1"),
    V.INT8: (struct.Struct("<b"), "<i1"),
    V.UINT16: (struct.Struct("<H"), "<u2"),
    V.INT16: (struct.Struct("<h"), "<i2"),
    V.UINT32: (struct.Struct("<I"), "<u4"),
    V.INT32: (struct.Struct("<i"), "<i4"),
    V.FLOAT32: (struct.Struct("<f"), "<f4"),
    V.BOOL: (struct.Struct("<?"), "?"),
    V.UINT64: (struct.Struct("<Q"), "<u8"),
    V.INT64: (struct.Struct("<q"), "<i8"),
    V.FLOAT64: (struct.Struct("<d"), "<f8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")
_ARRAY_HEADER = struct.Struct("<IQ")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's place in the file; `shape` is in numpy (outermost-first) order."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file
    n_bytes: int

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """Shape of the raw data as uint8 rows (what gguf.quants.dequantize expects)."""
        return quant_shape_to_byte_shape(self.shape, self.qtype)


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # includes GGUF.version, GGUF.tensor_count, GGUF.kv_count
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int  # absolute offset of the aligned data section


class _Cursor:
    """Reads GGUF primitives from a buffer, advancing `pos`."""

    def __init__(self, buf: Any, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def unpack(self, fmt: struct.Struct) -> tuple[Any, ...]:
        values = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return values

    def string(self) -> str:
        (length,) = _U64.unpack_from(self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        if self.pos > len(self.buf):
            raise ValueError(f"string of {length} bytes at offset {start} runs past the file")
        return str(self.buf[start : self.pos], encoding="utf-8")

    def skip_strings(self, count: int) -> None:
        buf, pos, unpack_from = self.buf, self.pos, _U64.unpack_from
        for _ in range(count):
            pos += 8 + unpack_from(buf, pos)[0]
        self.pos = pos

    def value(self, vtype: GGUFValueType, max_array_len: int | None) -> Any:
        """One value; arrays longer than max_array_len are skipped and read as None."""
        if vtype == V.STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0])[0]
        if vtype != V.ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        raw_item_type, count = self.unpack(_ARRAY_HEADER)
        item_type = GGUFValueType(raw_item_type)
        keep = max_array_len is None or count <= max_array_len
        if item_type in _SCALARS:  # bulk: one frombuffer for the whole array
            _, dtype = _SCALARS[item_type]
            start = self.pos
            self.pos += count * np.dtype(dtype).itemsize
            if self.pos > len(self.buf):
                raise ValueError(f"array of {count} items at offset {start} runs past the file")
            return np.frombuffer(self.buf, dtype, count, start).tolist() if keep else None
        if item_type == V.STRING and not keep:
            self.skip_strings(count)
            return None
        items = [self.value(item_type, None) for _ in range(count)]  # strings, nested arrays
        return items if keep else None


def parse_gguf_header(buf: Any, *, max_array_len: int | None = None) -> GGUFHeader:
    """Parse a GGUF header from a bytes-like buffer (bytes, mmap, numpy uint8).

    max_array_len: arrays with more items (tokenizer vocabularies, merges) are walked over but
    left out of `metadata`; None keeps every array.

    Raises:
        ValueError: not a little-endian GGUF v2/v3 file, or a malformed header.
    """
    try:
        return _parse(_Cursor(buf), max_array_len)
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"malformed GGUF header: {e}") from e


def _parse(cur: _Cursor, max_array_len: int | None) -> GGUFHeader:
    magic, version, tensor_count, kv_count = cur.unpack(_HEADER)
    if magic != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    if version not in SUPPORTED_VERSIONS:
        hint = " (big-endian files are not supported)" if version & 0xFFFF == 0 else ""
        raise ValueError(f"GGUF version {version} not supported{hint}; allowed: 2, 3")
    metadata: dict[str, Any] = {
        "GGUF.version": version,
        "GGUF.tensor_count": tensor_count,
        "GGUF.kv_count": kv_count,
    }
    for _ in range(kv_count):
        key = cur.string()
        if key in metadata:
            raise ValueError(f"duplicate GGUF key {key!r}")
        (vtype,) = cur.unpack(_U32)
        value = cur.value(GGUFValueType(vtype), max_array_len)
        if value is not None:
            metadata[key] = value

    infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]] = []
    for _ in range(tensor_count):
        name = cur.string()
        (n_dims,) = cur.unpack(_U32)
        dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
        cur.pos += 8 * n_dims
        raw_type, rel_offset = cur.unpack(_ARRAY_HEADER)  # same layout: u32, u64
        infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(raw_type), rel_offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid general.alignment {alignment!r}: must be a power of two")
    data_offset = -(-cur.pos // alignment) * alignment

    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, shape, qtype, rel_offset in infos:
        if name in seen:
            raise ValueError(f"duplicate GGUF tensor {name!r}")
        seen.add(name)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(shape, dtype=np.int64)) * type_size // block_size
        tensors.append(TensorInfo(name, qtype, shape, data_offset + rel_offset, n_bytes))
    return GGUFHeader(version, metadata, tensors, alignment, data_offset)


class GGUFFile:
    """A read-only memory map of a GGUF file: its parsed header plus raw tensor bytes."""

    def __init__(self, path: str | os.PathLike[str], *, max_array_len: int | None = None) -> None:
        with open(path, "rb") as f:
            # The map outlives the file descriptor; arrays from raw() keep it alive.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)  # plain ndarray, cheap slicing
        self.header = parse_gguf_header(self._map, max_array_len=max_array_len)

    def raw(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array of tensor.byte_shape (no copy)."""
        end = tensor.offset + tensor.n_bytes
        if end > self._bytes.size:
            raise ValueError(f"GGUF tensor {tensor.name!r} runs past the end of the file")
        return self._bytes[tensor.offset : end].reshape(tensor.byte_shape)
