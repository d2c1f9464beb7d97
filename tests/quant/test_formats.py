"""The registry's contract: shapes, sizes, dtypes and the errors a user sees."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.quant import q4_0, q8_0
from hybridmoe.quant.formats import WEIGHT_FORMATS, dense_format, weight_format

# ggml's (weights, bytes) per block (gguf.constants.GGML_QUANT_SIZES)
SIZES = {
    "f32": (1, 4), "bf16": (1, 2), "f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q2_k": (256, 84),
    "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
    "mxfp4": (32, 17),
}  # fmt: skip
K_QUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
BLOCKS_OF_32 = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"]  # the quantisers
FP16_SCALED = [name for name in BLOCKS_OF_32 if weight_format(name).scale_dtype == torch.float16]


def test_registry_holds_the_formats() -> None:
    assert list(WEIGHT_FORMATS) == list(SIZES)
    for name, (block_size, block_bytes) in SIZES.items():
        fmt = weight_format(name)
        assert (fmt.name, fmt.block_size, fmt.block_bytes) == (name, block_size, block_bytes)
        assert fmt.is_quantized == (block_size > 1)
        assert fmt.can_quantize == (name not in K_QUANTS)
    assert (q8_0.BLOCK_SIZE, q8_0.BLOCK_BYTES, q4_0.BLOCK_SIZE, q4_0.BLOCK_BYTES) == (
        32,
        34,
        32,
        18,
    )


@pytest.mark.parametrize(
    ("name", "stored", "row_bytes"),
    [("f32", (3, 4, 64), 256), ("bf16", (3, 4, 64), 128), ("q8_0", (3, 4, 68), 68),
     ("q4_0", (3, 4, 36), 36), ("mxfp4", (3, 4, 34), 34)],
)  # fmt: skip
def test_stored_shape_and_row_bytes(name: str, stored: tuple[int, ...], row_bytes: int) -> None:
    fmt = weight_format(name)
    assert fmt.stored_shape((3, 4, 64)) == stored
    assert fmt.row_bytes(64) == row_bytes
    q = fmt.quantize(torch.randn(3, 4, 64))
    assert q.shape == stored and q.dtype == fmt.storage_dtype and q.is_contiguous()
    assert q.numel() * q.element_size() == 12 * row_bytes
    back = fmt.dequantize(q, torch.bfloat16)
    assert back.shape == (3, 4, 64) and back.dtype == torch.bfloat16 and back.is_contiguous()


@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quants_have_no_quantiser(name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}: no quantiser .* one of f32, bf16, f16, q8_0"):
        weight_format(name).quantize(torch.randn(2, 256))


@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quant_shapes(name: str) -> None:
    fmt = weight_format(name)
    assert fmt.stored_shape((3, 4, 512)) == (3, 4, 2 * fmt.block_bytes)
    with pytest.raises(ValueError, match=rf"row length 96 is not a multiple of the {name} block"):
        fmt.stored_shape((2, 96))
    back = fmt.dequantize(torch.zeros(3, 2 * fmt.block_bytes, dtype=torch.uint8), torch.bfloat16)
    assert back.shape == (3, 512) and back.dtype == torch.bfloat16 and not back.any()


@pytest.mark.parametrize("name", BLOCKS_OF_32)
def test_non_contiguous_input_and_empty_rows(name: str) -> None:
    fmt = weight_format(name)
    w = torch.randn(64, 5)
    assert torch.equal(fmt.quantize(w.T), fmt.quantize(w.T.contiguous()))
    assert fmt.quantize(torch.empty(0, 64)).shape == (0, 64 // 32 * fmt.block_bytes)


def test_quantize_does_not_modify_its_input() -> None:
    w = torch.randn(4, 64)
    before = w.clone()
    for fmt in WEIGHT_FORMATS.values():
        if fmt.can_quantize:
            fmt.quantize(w)
    assert torch.equal(w, before)


@pytest.mark.parametrize("name", BLOCKS_OF_32)
def test_chunks_do_not_change_the_result(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = weight_format(name)
    w = torch.randn(10, 96)
    whole, back_whole = fmt.quantize(w), fmt.dequantize(fmt.quantize(w))
    monkeypatch.setattr("hybridmoe.quant._blocks.CHUNK_BLOCKS", 7)  # 30 blocks: 4 + 1 partial
    assert torch.equal(fmt.quantize(w), whole)
    assert torch.equal(fmt.dequantize(whole), back_whole)


@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quant_chunks_do_not_change_the_result(name: str, monkeypatch) -> None:
    fmt = weight_format(name)
    raw = torch.randint(0, 256, (5, 3 * fmt.block_bytes), dtype=torch.uint8)  # 15 blocks
    whole = fmt.dequantize(raw)
    monkeypatch.setattr("hybridmoe.quant._blocks.CHUNK_BLOCKS", 7 * 8)  # 7 super-blocks
    torch.testing.assert_close(fmt.dequantize(raw), whole, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", BLOCKS_OF_32)
@pytest.mark.parametrize("n", [31, 48, 100])
def test_row_length_not_a_multiple_of_the_block(name: str, n: int) -> None:
    fmt = weight_format(name)
    with pytest.raises(ValueError, match=rf"row length {n} is not a multiple of the {name} block"):
        fmt.quantize(torch.randn(2, n))
    with pytest.raises(ValueError, match=rf"layer 3 w1: row length {n} .* of 32 weights"):
        fmt.check_row_length(n, "layer 3 w1")
    with pytest.raises(ValueError, match=rf"row length {n}"):
        fmt.stored_shape((2, n))
    with pytest.raises(ValueError, match=rf"{fmt.block_bytes} bytes"):
        fmt.dequantize(torch.zeros(2, fmt.block_bytes + 1, dtype=torch.uint8))


@pytest.mark.parametrize("name", BLOCKS_OF_32)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("position", [0, 17, 31])
def test_non_finite_input(name: str, bad: float, position: int) -> None:
    w = torch.randn(3, 64)
    w[2, 32 + position] = bad
    with pytest.raises(ValueError, match=r"row 2 has a non-finite weight"):
        weight_format(name).quantize(w)


@pytest.mark.parametrize("name", FP16_SCALED)
def test_scale_beyond_fp16(name: str) -> None:
    w = torch.zeros(2, 32)
    w[1, 0] = 1e9
    with pytest.raises(ValueError, match=r"row 1 has a block scale beyond the fp16 range"):
        weight_format(name).quantize(w)


def test_wrong_dtypes() -> None:
    with pytest.raises(TypeError, match="float tensor"):
        weight_format("q8_0").quantize(torch.ones(32, dtype=torch.int32))
    with pytest.raises(TypeError, match="uint8"):
        weight_format("q4_0").dequantize(torch.zeros(18))


def test_unknown_names_and_dtypes() -> None:
    with pytest.raises(ValueError, match=r"unknown weight format 'q7_k'.*f32, bf16, f16, q8_0"):
        weight_format("q7_k")
    assert dense_format(torch.float32).name == "f32"
    assert dense_format(torch.bfloat16).name == "bf16"
    assert dense_format(torch.float16).name == "f16"
    with pytest.raises(ValueError, match="float64"):
        dense_format(torch.float64)
