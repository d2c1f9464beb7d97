"""A bank holding gate and up as two tensors (a GGUF file's merged ffn_gate_exps / ffn_up_exps,
memory-mapped) is built without copying and computes exactly what the stacked bank of the same
bytes computes, on every path: the fused numba kernel, the torch reference, gathered_moe, and
the slot / copy / placement methods keep its layout."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from hybridmoe.kernels.torch_moe import gathered_moe
from hybridmoe.moe.cpu_experts import bank_moe, fused_cpu_moe
from hybridmoe.quant.bank import ExpertBank, ExpertWeights
from hybridmoe.quant.formats import weight_format

E, H, INTER, K = 6, 64, 96, 2
GGUF_TYPES = {
    "f32": GGMLQuantizationType.F32,
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
    "mxfp4": GGMLQuantizationType.MXFP4,
}
NAMES = ("gate", "up", "down")


def float_experts(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"gate": (E, INTER, H), "up": (E, INTER, H), "down": (E, H, INTER)}
    return {
        name: torch.randn(shape, generator=g) / shape[-1] ** 0.5 for name, shape in shapes.items()
    }


def write_gguf(path: Path, fmt_name: str) -> None:
    """A GGUF file with one layer's merged expert tensors in `fmt_name`, 64-byte aligned (the
    torch reference's GEMV may round by a dense weight's address: loader.weights.aligned)."""
    fmt = weight_format(fmt_name)
    writer = GGUFWriter(path, "qwen3moe")
    writer.add_custom_alignment(64)
    for name, w in float_experts().items():
        stored = fmt.quantize(w).contiguous()  # [E, rows, row_bytes(n) / itemsize]
        raw = stored.view(torch.uint8) if fmt_name == "bf16" else stored
        writer.add_tensor(
            f"blk.0.ffn_{name}_exps.weight", raw.numpy(), raw_dtype=GGUF_TYPES[fmt_name]
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def mapped_bank(path: Path, fmt_name: str) -> tuple[ExpertBank, GGUFReader]:
    """The bank made of the file's tensors themselves (views of the reader's mapping)."""
    fmt = weight_format(fmt_name)
    reader = GGUFReader(path)
    arrays = {t.name: t.data for t in reader.tensors}
    with warnings.catch_warnings():  # the mapping is read-only; a bank never writes to it
        warnings.simplefilter("ignore", UserWarning)
        tensors = {
            name: torch.from_numpy(arrays[f"blk.0.ffn_{name}_exps.weight"]) for name in NAMES
        }
    if fmt_name == "bf16":  # the reader gives BF16 tensors as their bytes
        tensors = {name: t.view(torch.bfloat16) for name, t in tensors.items()}
    return ExpertBank(**tensors, fmt=fmt), reader


@pytest.fixture(params=list(GGUF_TYPES))
def banks(request, tmp_path: Path) -> tuple[ExpertBank, ExpertBank, GGUFReader]:
    """(separate bank over the file, stacked copy of the same bytes, the reader)."""
    path = tmp_path / f"experts-{request.param}.gguf"
    write_gguf(path, request.param)
    separate, reader = mapped_bank(path, request.param)
    gate_up = torch.cat([separate.gate, separate.up], dim=1)  # [E, 2I, ...] copy
    return separate, ExpertBank(gate_up, separate.down.clone(), separate.fmt), reader


def routes(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    ids[0, 1] = -1  # a skipped route
    return torch.randn(tokens, H, generator=g), ids, torch.rand(tokens, K, generator=g)


def test_the_bank_is_the_mapping_itself(banks):
    separate, _, reader = banks
    start = reader.data.ctypes.data
    end = start + reader.data.nbytes
    assert not separate.stacked
    for tensor in separate.tensors():
        assert start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= end
    gate, up, expert_rows, down = separate.byte_views()
    assert expert_rows == INTER
    for name, view in zip(NAMES, (gate, up, down), strict=True):
        assert start <= view.ctypes.data < end, name
    with pytest.raises(ValueError, match="separate tensors"):
        _ = separate.gate_up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3])
def test_separate_gate_up_compute_exactly_as_stacked(banks, dtype, tokens):
    separate, stacked, _ = banks
    x, ids, weights = routes(tokens)
    x, weights = x.to(dtype), weights.to(dtype)
    expected = fused_cpu_moe(x, ids, weights, stacked)
    assert expected.abs().sum() > 0
    assert torch.equal(fused_cpu_moe(x, ids, weights, separate), expected)
    # torch's GEMMs: each output value is one row's dot product, whatever the rows around it
    assert torch.equal(bank_moe(x, ids, weights, separate), bank_moe(x, ids, weights, stacked))
    gathered = gathered_moe(x, ids.clamp(min=0), weights, separate)
    assert torch.equal(gathered, gathered_moe(x, ids.clamp(min=0), weights, stacked))


def test_slots_copies_and_placement_keep_the_layout(banks):
    separate, stacked, _ = banks
    slots = separate.empty_slots(3, "cpu")
    assert not slots.stacked and stacked.empty_slots(3, "cpu").stacked
    assert not any(t.any() for t in slots.tensors())
    pairs = separate.expert_copies(4, slots, 1)
    assert len(pairs) == 3 and all(dst.is_contiguous() for _, dst in pairs)
    for src, dst in pairs:
        dst.copy_(src)
    for name in NAMES:
        assert torch.equal(getattr(slots, name)[1], getattr(stacked, name)[4]), name
    assert len(stacked.expert_copies(4, stacked.empty_slots(3, "cpu"), 1)) == 2
    whole = separate.empty_slots(E, "cpu")
    for src, dst in separate.copies_into(whole):
        dst.copy_(src)
    for moved in (whole, separate.in_own_pages(), separate.to("meta")):
        assert not moved.stacked and moved.fmt == separate.fmt
        assert [t.shape for t in moved.tensors()] == [t.shape for t in separate.tensors()]
    for name in NAMES:
        assert torch.equal(getattr(whole, name), getattr(separate, name)), name
    assert separate.expert_nbytes == stacked.expert_nbytes and separate.nbytes == stacked.nbytes


@pytest.mark.parametrize("target", ["q8_0", "q4_0", "f32"])
def test_conversion_is_the_same_bytes_in_either_layout(banks, target):
    separate, stacked, _ = banks
    fmt = weight_format(target)
    a, b = separate.converted(fmt), stacked.converted(fmt)
    assert not a.stacked and b.stacked
    for name in NAMES:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("target", ["q8_0", "q4_0", "bf16"])
def test_stacking_into_a_format_equals_stacking_then_converting(target):
    experts = float_experts(seed=3)
    weights = ExpertWeights(*(list(experts[name].to(torch.bfloat16)) for name in NAMES))
    fmt = weight_format(target)
    direct, two_pass = ExpertBank.stack(weights, fmt), ExpertBank.stack(weights).converted(fmt)
    assert direct.stacked and direct.fmt == fmt
    for name in ("gate_up", "down"):
        assert torch.equal(getattr(direct, name), getattr(two_pass, name)), name


def test_a_bank_needs_one_gate_up_layout():
    gate = torch.zeros(E, INTER, H)
    with pytest.raises(TypeError, match="either gate_up, or both gate and up"):
        ExpertBank(down=torch.zeros(E, H, INTER), gate=gate)
    with pytest.raises(ValueError, match="one shape"):
        ExpertBank(gate=gate, up=gate[:, 1:], down=torch.zeros(E, H, INTER))
    with pytest.raises(ValueError, match=r"not \[E, 2I, H\]"):
        ExpertBank(torch.zeros(E, 2 * INTER + 1, H), torch.zeros(E, H, INTER))
    stacked = ExpertBank(torch.zeros(E, 2 * INTER, H), torch.zeros(E, H, INTER))
    gate_bytes, up_bytes, expert_rows, _ = stacked.byte_views()
    assert np.shares_memory(gate_bytes, up_bytes) and expert_rows == 2 * INTER
