"""gguf_read (our GGUF header parser) against its reference, gguf-py's GGUFReader: the same
fields (types and values), the same tensors (type, dims, offset, dtype, shape, bytes) on a
model file and on a file with every value type, nested and empty arrays, every float tensor
type and a non-default alignment; a cut or corrupted file is a CorruptGguf, never a crash."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType

from gguf_checkpoints import write_gguf
from hf_checkpoints import write_hf_checkpoint
from hybridmoe.loader.gguf_read import CorruptGguf, read_gguf


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf_read")
    hf = write_hf_checkpoint("qwen3_moe", "mha_tied_top1", root / "hf")
    return write_gguf(hf, root / "model.gguf", "Q4_0")


def _every_kind(path: Path, alignment: int | None) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "test")
    if alignment is not None:
        writer.add_custom_alignment(alignment)  # the key, and the writer pads so
    scalars = [VType.UINT8, VType.INT8, VType.UINT16, VType.INT16, VType.UINT32, VType.INT32]
    scalars += [VType.UINT64, VType.INT64, VType.FLOAT32, VType.FLOAT64]
    for kind in scalars:
        value = 1.25 if kind in (VType.FLOAT32, VType.FLOAT64) else 7
        writer.add_key_value(f"s.{kind.name}", value, kind)
        writer.add_key_value(f"a.{kind.name}", [value, 2 * value, 0], VType.ARRAY, sub_type=kind)
    writer.add_bool("s.bool", True)
    writer.add_array("a.bool", [True, False, True])
    writer.add_string("s.str", "héllo ▁wörld")
    writer.add_array("a.str", ["", "a", "ĠĊ", "x" * 300, "日本"])
    writer.add_array("a.empty", [])
    writer.add_array("a.nested", [[1, 2], [3]])
    for name, qtype, dtype in [
        ("f32", QType.F32, np.float32),
        ("f16", QType.F16, np.float16),
        ("i32", QType.I32, np.int32),
    ]:
        writer.add_tensor(name, (rng.standard_normal((3, 64)) * 10).astype(dtype), raw_dtype=qtype)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    for qtype in (QType.BF16, QType.Q8_0, QType.Q4_0):
        writer.add_tensor(qtype.name.lower(), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.add_tensor("vec", rng.standard_normal(5).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_same_as_gguf_reader(path: Path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    reference = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(reference)
    for key, field in ours.fields.items():
        assert list(field.types) == reference[key].types, key
        value, expected = field.value, reference[key].contents()
        assert value == expected and type(value) is type(expected), key
        if isinstance(value, list):
            assert [type(v) for v in value] == [type(v) for v in expected], key
    assert ours.version == theirs.fields["GGUF.version"].contents()
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type and mine.dims == tuple(ref.shape.tolist())
        assert mine.offset == ref.data_offset
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data.view(np.uint8), np.asarray(ref.data).view(np.uint8))


def test_model_file_reads_as_gguf_reader_reads_it(model_file: Path) -> None:
    _assert_same_as_gguf_reader(model_file)


@pytest.mark.parametrize("alignment", [None, 64, 8])
def test_every_value_and_tensor_kind_reads_as_gguf_reader_reads_it(
    tmp_path: Path, alignment: int | None
) -> None:
    _assert_same_as_gguf_reader(_every_kind(tmp_path / "kinds.gguf", alignment))


def test_tensor_views_are_writable_without_touching_the_file(tmp_path: Path) -> None:
    path = _every_kind(tmp_path / "kinds.gguf", None)
    before = path.read_bytes()
    tensor = next(t for t in read_gguf(path).tensors if t.name == "f32")
    tensor.data[:] = 0
    assert path.read_bytes() == before


def test_every_cut_of_the_header_is_corrupt_gguf(tmp_path: Path) -> None:
    """A file cut anywhere in its header or tensor table, or before its last tensor's end."""
    path = _every_kind(tmp_path / "kinds.gguf", None)
    data, reader = path.read_bytes(), gguf.GGUFReader(path)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    cuts = list(range(24, reader.data_offset, 7)) + [last.data_offset + last.n_bytes - 1]
    for cut in cuts:
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CorruptGguf):
            read_gguf(tmp_path / "cut.gguf")


@pytest.mark.parametrize(
    ("find", "replace", "message"),
    [
        (b"s.UINT8\x00\x00\x00\x00", b"s.UINT8\x63\x00\x00\x00", "unknown metadata value type 99"),
        (b"s.UINT8", b"s.INT16", "metadata key 's.INT16' appears twice"),
        (b"\x00f32\x02\x00", b"\x00f16\x02\x00", "tensor 'f16' appears twice"),
    ],
    ids=["value-type", "duplicate-key", "duplicate-tensor"],
)
def test_corrupt_header_is_named(tmp_path: Path, find: bytes, replace: bytes, message: str):
    data = _every_kind(tmp_path / "kinds.gguf", None).read_bytes()
    assert data.count(find) == 1
    (tmp_path / "bad.gguf").write_bytes(data.replace(find, replace))
    with pytest.raises(CorruptGguf, match=message):
        read_gguf(tmp_path / "bad.gguf")
