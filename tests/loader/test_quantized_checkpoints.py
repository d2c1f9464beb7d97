"""Quantised checkpoints are refused until a format is supported: a config.json that declares a
`quantization_config` is refused naming it and its `quant_method`, and, as a second line of
defence, so is any weight stored as float8 or an integer (a quantised weight, whose values mean
nothing without their scales), naming the tensor. Plain float weights of any width still load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridmoe.errors import CheckpointError, UnsupportedConfigError
from hybridmoe.models.loading import load_model

WEIGHTS_FILE = "model.safetensors"
EXPERT_TENSOR = "model.layers.2.mlp.experts.5.up_proj.weight"
FP8_BLOCK_CONFIG = {  # DeepSeek-V3 / Qwen3-FP8 style
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}


def with_weights(
    demo_checkpoint: Path,
    demo_variant: Callable[..., Path],
    edit: Callable[[dict[str, torch.Tensor]], None],
    config_changes: dict | None = None,
) -> Path:
    """A demo variant (config.json changed by `config_changes`) whose model.safetensors holds
    the demo's weights after `edit`."""
    directory = demo_variant(config_changes, skip=(WEIGHTS_FILE,))
    weights = load_file(str(demo_checkpoint / WEIGHTS_FILE))
    edit(weights)
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def to_fp8_with_block_scales(weights: dict[str, torch.Tensor]) -> None:
    """The demo's experts of layer 2 as an FP8 block-quantised checkpoint stores them: e4m3
    values beside a float32 `weight_scale_inv` per 128 x 128 block."""
    for name in [n for n in weights if n.startswith("model.layers.2.mlp.experts.")]:
        weight = weights[name]
        scale = weight.abs().max().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        weights[name] = (weight / scale).to(torch.float8_e4m3fn)
        blocks = [-(-size // 128) for size in weight.shape]
        weights[name.removesuffix("weight") + "weight_scale_inv"] = torch.full(blocks, scale)


@pytest.mark.parametrize(
    "quantization",
    [
        FP8_BLOCK_CONFIG,
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
        {"quant_method": "mxfp4"},
        {"bits": 4},  # no quant_method at all
        "fp8",  # not even an object
    ],
)
def test_quantization_config_is_refused_naming_it(demo_variant, quantization):
    directory = demo_variant({"quantization_config": quantization})
    with pytest.raises(UnsupportedConfigError) as info:
        load_model(directory)
    message = str(info.value)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    assert "quantization_config" in message and f"quant_method {method!r}" in message
    assert str(directory / "config.json") in message


def test_null_quantization_config_is_absent(demo_variant):
    assert load_model(demo_variant({"quantization_config": None})).cfg.num_experts == 8


def test_fp8_block_checkpoint_is_refused_at_its_config(demo_checkpoint, demo_variant):
    directory = with_weights(
        demo_checkpoint,
        demo_variant,
        to_fp8_with_block_scales,
        {"quantization_config": FP8_BLOCK_CONFIG},
    )
    with pytest.raises(UnsupportedConfigError, match="quantization_config.*'fp8'"):
        load_model(directory)


def test_fp8_weights_without_a_quantization_config_are_refused(demo_checkpoint, demo_variant):
    # The second line of defence: the weights alone give the format away.
    directory = with_weights(demo_checkpoint, demo_variant, to_fp8_with_block_scales)
    with pytest.raises(CheckpointError) as info:
        load_model(directory)
    message = str(info.value)
    assert "model.layers.2.mlp.experts." in message and "float8_e4m3fn" in message
    assert str(directory / WEIGHTS_FILE) in message


@pytest.mark.parametrize(
    "dtype",
    [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8, torch.int32, torch.bool],
)
@pytest.mark.parametrize("load_dtype", [torch.float32, torch.bfloat16])
def test_weight_of_a_quantised_dtype_is_refused_naming_it(
    demo_checkpoint, demo_variant, dtype, load_dtype
):
    def store_as(weights: dict[str, torch.Tensor]) -> None:
        weights[EXPERT_TENSOR] = weights[EXPERT_TENSOR].to(dtype)

    directory = with_weights(demo_checkpoint, demo_variant, store_as)
    with pytest.raises(CheckpointError) as info:
        load_model(directory, load_dtype)
    assert info.type is CheckpointError, f"expected a plain CheckpointError, got {info.value!r}"
    message = str(info.value)
    dtype_name = str(dtype).removeprefix("torch.")
    assert f"'{EXPERT_TENSOR}'" in message and f"stored as {dtype_name}," in message


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.bfloat16])
def test_plain_float_weights_of_any_width_load(demo_checkpoint, demo_variant, dtype):
    def store_as(weights: dict[str, torch.Tensor]) -> None:
        weights[EXPERT_TENSOR] = weights[EXPERT_TENSOR].to(dtype)

    model = load_model(with_weights(demo_checkpoint, demo_variant, store_as))
    assert model.cfg.num_experts == 8
