"""A GGUF file's header (metadata and tensor table) parsed in a few passes over the mapping, and
its tensors as numpy views of it: what gguf-py's GGUFReader gives, without its cost. GGUFReader
builds a numpy memmap slice (two, for a string) per metadata value: for a 150k-token
vocabulary and as many merges, ~10^6 slices, seconds of every load. Here a string array is
one loop over length-prefixed bytes and a numeric array one np.frombuffer.

GGUFReader stays the reference: tests/loader/test_gguf_read.py compares every field's types
and value and every tensor's type, shape, offset and bytes on the same files. The file format
(little-endian, versions 2 and 3): magic, version u32, tensor count u64, key count u64; each key
a string (u64 length + UTF-8), a value type u32 and the value (an array: item type u32, count
u64, items); each tensor a name, dims count u32, dims u64 (innermost first), ggml type u32 and
offset u64 from the data start, which is the end of the table rounded up to
`general.alignment` (default 32). Errors are CorruptGguf (the caller names the file).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

STRING, ARRAY = GGUFValueType.STRING, GGUFValueType.ARRAY
# value type -> numpy dtype of its items (what GGUFReader reads each scalar type as)
SCALARS = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("?"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# ggml types stored one value an item, read as that dtype (as GGUFReader does); the others as
# uint8 [..., row bytes]
ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}
DEFAULT_ALIGNMENT = 32
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class CorruptGguf(ValueError):
    """The bytes are not a well-formed GGUF header or tensor table."""


@dataclass(frozen=True)
class GgufField:
    """One metadata value: its value type (then, for an array, the item type, nested arrays
    flattened as GGUFReader does), and the value as Python objects (an array: a flat list)."""

    types: tuple[GGUFValueType, ...]
    value: Any


@dataclass(frozen=True)
class GgufTensorData:
    """One tensor: its ggml type, dims in GGUF order (innermost first), absolute byte offset,
    and its bytes as a numpy view of the mapping (ELEMENT_DTYPES' dtype [*dims reversed], else
    uint8 [*outer dims reversed, row bytes])."""

    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int
    data: np.ndarray


@dataclass(frozen=True)
class GgufHeader:
    version: int
    fields: dict[str, GgufField]
    tensors: list[GgufTensorData]
    mapped: np.ndarray  # uint8 [file bytes]: the mapping every tensor's data is a view of


def read_gguf(path: Path) -> GgufHeader:
    """The header and tensors of the GGUF file at `path`, mapped copy-on-write (a view handed
    to torch is writable without touching the file); CorruptGguf when malformed."""
    mapped = np.memmap(path, mode="c").view(np.ndarray)  # uint8 [file bytes], plain views
    buf = memoryview(mapped)
    try:
        version, tensor_count, key_count = struct.unpack_from("<IQQ", buf, 4)
        fields: dict[str, GgufField] = {}
        pos = 24
        for _ in range(key_count):
            key, pos = _string(buf, pos)
            if key in fields:
                raise CorruptGguf(f"metadata key '{key}' appears twice")
            (value_type,), pos = _U32.unpack_from(buf, pos), pos + 4
            types, value, pos = _value(buf, pos, _value_type(value_type))
            fields[key] = GgufField(types, value)
        table, pos = _tensor_table(buf, pos, tensor_count)
    except struct.error as exc:
        raise CorruptGguf(f"the header ends early ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise CorruptGguf(f"a string is not UTF-8 ({exc})") from exc
    start = _aligned(pos, _alignment(fields))
    return GgufHeader(version, fields, [_tensor(mapped, start, *info) for info in table], mapped)


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise CorruptGguf(f"a string of {length} bytes at offset {pos} runs past the end")
    return str(buf[pos + 8 : end], "utf-8"), end


def _strings(buf: memoryview, pos: int, count: int) -> tuple[list[str], int]:
    """`count` length-prefixed strings from `pos` (the hot loop of a vocabulary: kept flat)."""
    out: list[str] = []
    append, unpack, size = out.append, _U64.unpack_from, len(buf)
    for _ in range(count):
        (length,) = unpack(buf, pos)
        pos += 8
        if pos + length > size:
            raise CorruptGguf(f"a string of {length} bytes at offset {pos} runs past the end")
        append(str(buf[pos : pos + length], "utf-8"))
        pos += length
    return out, pos


def _value_type(raw: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise CorruptGguf(f"unknown metadata value type {raw}") from None


def _value(buf: memoryview, pos: int, kind: GGUFValueType) -> tuple[tuple, Any, int]:
    """(types, value, next offset) of one value of type `kind` at `pos`."""
    if kind == STRING:
        value, pos = _string(buf, pos)
        return (kind,), value, pos
    if kind in SCALARS:
        dtype = SCALARS[kind]
        return (kind,), _numbers(buf, pos, dtype, 1)[0], pos + dtype.itemsize
    item_type, count = struct.unpack_from("<IQ", buf, pos)
    item, pos = _value_type(item_type), pos + 12
    if item == STRING:
        values, pos = _strings(buf, pos, count)
        return (kind, item), values, pos
    if item in SCALARS:
        dtype = SCALARS[item]
        return (kind, item), _numbers(buf, pos, dtype, count), pos + count * dtype.itemsize
    types, values = (kind,), []
    for i in range(count):  # arrays of arrays: flattened, the first one's types
        sub_types, sub, pos = _value(buf, pos, item)
        types = (kind, *sub_types) if i == 0 else types
        values.extend(sub if isinstance(sub, list) else [sub])
    return types, values, pos


def _numbers(buf: memoryview, pos: int, dtype: np.dtype, count: int) -> list:
    if pos + count * dtype.itemsize > len(buf):
        raise CorruptGguf(f"an array of {count} {dtype} at offset {pos} runs past the end")
    return np.frombuffer(buf, dtype, count, pos).tolist()


def _tensor_table(buf: memoryview, pos: int, count: int) -> tuple[list[tuple], int]:
    """[(name, ggml type, dims, offset from the data start)] of `count` tensors at `pos`."""
    table, names = [], set()
    for _ in range(count):
        name, pos = _string(buf, pos)
        if name in names:
            raise CorruptGguf(f"tensor '{name}' appears twice")
        names.add(name)
        (n_dims,) = _U32.unpack_from(buf, pos)
        if pos + 16 + 8 * n_dims > len(buf):
            raise CorruptGguf(f"tensor '{name}' ({n_dims} dims) runs past the end")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        pos += 4 + 8 * n_dims
        raw_type, offset = struct.unpack_from("<IQ", buf, pos)
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise CorruptGguf(f"tensor '{name}' has unknown ggml type {raw_type}") from None
        table.append((name, tensor_type, dims, offset))
        pos += 12
    return table, pos


def _alignment(fields: dict[str, GgufField]) -> int:
    field = fields.get("general.alignment")
    if field is None:
        return DEFAULT_ALIGNMENT
    if field.types != (GGUFValueType.UINT32,):
        raise CorruptGguf("metadata key 'general.alignment' must be a uint32")
    if field.value <= 0 or field.value & (field.value - 1):
        raise CorruptGguf(f"'general.alignment' = {field.value} is not a power of two")
    return field.value


def _aligned(pos: int, alignment: int) -> int:
    return -(-pos // alignment) * alignment


def _tensor(mapped: np.ndarray, start: int, name, tensor_type, dims, offset) -> GgufTensorData:
    shape = tuple(reversed(dims))  # numpy order
    block, type_bytes = GGML_QUANT_SIZES[tensor_type]
    elements = int(np.prod(dims, dtype=np.int64))
    if shape and shape[-1] % block:
        raise CorruptGguf(f"tensor '{name}' rows of {shape[-1]} are not whole {block}-blocks")
    size, begin = elements * type_bytes // block, start + offset
    if begin + size > len(mapped):
        raise CorruptGguf(f"tensor '{name}' ({size} bytes at {begin}) runs past the end")
    dtype = ELEMENT_DTYPES.get(tensor_type)
    if dtype is None:
        dtype, shape = np.dtype(np.uint8), (*shape[:-1], shape[-1] // block * type_bytes)
    data = mapped[begin : begin + size].view(dtype).reshape(shape)
    return GgufTensorData(name, tensor_type, tuple(dims), begin, data)
