"""gpt-oss with MXFP4 experts, as published (`quantization_config.quant_method` "mxfp4",
`*_proj_blocks` / `*_proj_scales` uint8 in the Hugging Face layout), against `transformers` on
the same model with those experts dequantised to float32: identical greedy tokens and logits
within float32 tolerance for every decode target, with the experts kept in the mxfp4 format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_checkpoints import PROMPT_IDS, SHORT_PROMPT_IDS, hf_greedy, hf_logits, write_hf_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.errors import CheckpointError
from hybridmoe.models.loading import load_hf_model
from hybridmoe.moe.config import OffloadConfig
from mxfp4_layout import MXFP4, quantize_hf

CASE = ("gpt_oss", "mqa_full_first_top4")  # hidden 64, intermediate 32: whole MXFP4 blocks
N_GREEDY = 12
GREEDY = SamplingParams(max_tokens=N_GREEDY, temperature=0.0, ignore_eos=True)
TARGETS = [
    OffloadConfig(decode_target="cpu"),
    OffloadConfig(decode_target="resident"),
    OffloadConfig(decode_target="hybrid", expert_cache_slots=2, max_fetch=1),
]
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"]


def _write(directory: Path, tensors: dict, config: dict) -> Path:
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, the float32 checkpoint of its dequantised experts)."""
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    source = write_hf_checkpoint(*CASE, root / "float")
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    quantised, dequantised = dict(tensors), dict(tensors)
    for name, weight in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        rows = weight.transpose(1, 2).contiguous()  # [E, out, in]: the layout's rows
        blocks, scales = quantize_hf(rows)
        del quantised[name]
        quantised[f"{name}_blocks"], quantised[f"{name}_scales"] = blocks, scales
        exact = MXFP4.dequantize(MXFP4.quantize(rows), torch.float32)  # [E, out, in]
        dequantised[name] = exact.transpose(1, 2).contiguous()
    quant_config = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    mxfp4 = _write(root / "mxfp4", quantised, {**config, "quantization_config": quant_config})
    return mxfp4, _write(root / "dequantised", dequantised, config)


@pytest.mark.parametrize("offload", TARGETS, ids=lambda o: o.decode_target)
def test_every_target_gives_transformers_tokens(checkpoints, offload) -> None:
    mxfp4, dequantised = checkpoints
    expected = [hf_greedy(dequantised, p, N_GREEDY) for p in (PROMPT_IDS, SHORT_PROMPT_IDS)]
    config = EngineConfig(device="cpu", dtype="float32", max_seq_len=64, offload=offload)
    with Engine.from_pretrained(mxfp4, config) as engine:
        assert engine.generate_ids([PROMPT_IDS, SHORT_PROMPT_IDS], GREEDY) == expected


def test_logits_match_and_experts_stay_mxfp4(checkpoints) -> None:
    mxfp4, dequantised = checkpoints
    model = load_hf_model(mxfp4)
    banks = [layer.experts.store for layer in model.moe_layers]
    assert all(bank.formats == (MXFP4, MXFP4) and bank.biases is not None for bank in banks)
    ours = model.logits(PROMPT_IDS)  # [T, V]
    torch.testing.assert_close(ours, hf_logits(dequantised, PROMPT_IDS), atol=1e-4, rtol=1e-4)


def test_mis_stored_blocks_are_refused_naming_the_tensor(checkpoints, tmp_path) -> None:
    mxfp4, _ = checkpoints
    tensors = load_file(mxfp4 / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name].to(torch.int16)
    config = json.loads((mxfp4 / "config.json").read_text())
    broken = _write(tmp_path / "broken", tensors, config)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is int16"):
        load_hf_model(broken)
