"""loader/gguf.GgufFile's tensors are views of one torch tensor over the file's mapping: the
bytes, dtype and shape of gguf_read's numpy views (its tested reading), all in one storage,
so a layer's q, k and v stored back to back stack without a copy (kernels/projection
.adjacent_rows); a tensor whose offset is no multiple of its item size gets its own view."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from gguf_checkpoints import write_gguf
from hf_checkpoints import write_hf_checkpoint
from hybridmoe.kernels.projection import adjacent_rows
from hybridmoe.loader import gguf as gguf_module
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.loader.gguf_read import GgufTensorData, read_gguf


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf_storage")
    hf = write_hf_checkpoint("qwen3_moe", "mha_tied_top1", root / "hf")
    return write_gguf(hf, root / "model.gguf", "Q4_0")


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def test_tensors_are_gguf_reads_bytes_in_one_storage(model_file: Path) -> None:
    reference = {t.name: t for t in read_gguf(model_file).tensors}
    tensors = GgufFile(model_file).tensors
    assert tensors.keys() == reference.keys()
    storages = {t.data.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storages) == 1
    for name, tensor in tensors.items():
        want = reference[name].data
        assert tensor.data.shape == want.shape, name
        assert tensor.data.dtype == torch.from_numpy(want[:0]).dtype, name
        assert np.array_equal(_bytes(tensor.data), want.view(np.uint8).reshape(-1)), name


def _written(path: Path, order: list[str]) -> Path:
    """A GGUF holding F32 q [8, 64], k and v [4, 64] and a norm [64], in `order` (the
    converter writes a checkpoint's tensors in its order: q, k, v back to back or not)."""
    rng = np.random.default_rng(1)
    rows = {"q": 8, "k": 4, "v": 4, "norm": 1}
    writer = gguf.GGUFWriter(str(path), "test")
    for name in order:
        shape = (rows[name], 64) if name != "norm" else (64,)
        writer.add_tensor(f"blk.0.attn_{name}.weight", rng.standard_normal(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "order", [["norm", "q", "k", "v"], ["q", "norm", "k", "v"], ["k", "q", "v", "norm"]]
)
def test_q_k_v_stored_back_to_back_stack_as_a_view(tmp_path: Path, order: list[str]) -> None:
    tensors = GgufFile(_written(tmp_path / "m.gguf", order)).tensors
    weights = [tensors[f"blk.0.attn_{p}.weight"].data for p in "qkv"]
    stacked = adjacent_rows(weights)
    if order[1:] != ["q", "k", "v"]:
        assert stacked is None
        return
    assert stacked is not None and stacked.data_ptr() == weights[0].data_ptr()
    assert torch.equal(stacked, torch.cat(weights))


def test_a_tensor_at_an_odd_offset_gets_its_own_view(tmp_path: Path) -> None:
    raw = np.arange(64, dtype=np.uint8)
    whole = torch.from_numpy(raw)
    values = np.frombuffer(bytearray(raw.tobytes()[2:18]), np.float32)  # what numpy views there
    odd = GgufTensorData("odd", QType.F32, (4,), 2, values)
    tensor = gguf_module._tensor(odd, tmp_path / "x.gguf", whole)
    assert tensor.data.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
    assert np.array_equal(tensor.data.numpy(), values)
