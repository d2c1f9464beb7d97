"""gpt-oss GGUF files written in the tests from `transformers` checkpoints, as llama.cpp's
converter (convert_hf_to_gguf.py, GptOssModel) writes them: `general.architecture` gpt-oss,
its metadata keys (gguf-py's `Keys`, including `attention.sliding_window`,
`expert_feed_forward_length` and the YaRN `rope.scaling.*`), gguf-py's own tensor-name map
(`gguf.get_tensor_name_map(MODEL_ARCH.GPT_OSS, ...)`, deliberately not hybridmoe's table), the
sinks as `attn_sinks.weight`, and the fused experts split as the converter splits them:
`gate_up_proj` [E, H, 2I] transposed, its even rows the gate (`ffn_gate_exps` [E, I, H]) and
its odd rows the up projection (`ffn_up_exps`), `down_proj` [E, I, H] transposed
(`ffn_down_exps` [E, H, I]), `gate_up_proj_bias` split likewise. Nothing is downloaded.

`write_gpt_oss_encoded_checkpoint` gives the float checkpoint a GGUF stands for (experts
replaced by what the file stores, dequantised by gguf.quants): the model transformers runs.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType
from safetensors.torch import load_file, save_file

from gguf_checkpoints import ExpertEncoder, _add_tokenizer, _quantizer

ARCH = "gpt-oss"
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # as the converter names them
_EXPERTS = ".mlp.experts"
# GGUF MXFP4 block: one E8M0 exponent byte, then 16 bytes of 32 E2M1 codes
MXFP4_BLOCK, MXFP4_BYTES = 32, 17


def write_gpt_oss_gguf(
    hf_dir: Path,
    path: Path,
    expert_type: str = "F32",
    experts: ExpertEncoder | None = None,
    tokenizer: dict | None = None,
    chat_template: str | None = None,
    drop_keys: tuple[str, ...] = (),
    extra: dict[str, int] | None = None,
) -> Path:
    """`hf_dir`'s gpt-oss model as a GGUF at `path`, experts in ggml type `expert_type` (or as
    `experts` encodes each merged tensor), dense tensors F32, without the metadata keys
    `drop_keys` and with the uint32 keys `extra`. `tokenizer`: as gguf_checkpoints.write_gguf
    takes it."""
    config = json.loads((hf_dir / "config.json").read_text())
    types = config.get("layer_types")
    if types is not None and types != _llama_cpp_layer_types(config["num_hidden_layers"]):
        raise ValueError(f"{hf_dir}: GGUF has no layer_types; llama.cpp's are fixed, not {types}")
    tensors = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), ARCH)
    metadata = gpt_oss_metadata(config)
    metadata.update({key: (value, VType.UINT32) for key, value in (extra or {}).items()})
    for key, (value, vtype) in metadata.items():
        if key not in drop_keys:
            writer.add_key_value(key, value, vtype)
    _add_tokenizer(writer, tokenizer, config)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    encoder = experts or _quantizer(QType[expert_type])
    for name, data, qtype in _gguf_tensors(config, tensors, encoder):
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gpt_oss_encoded_checkpoint(hf_dir: Path, out_dir: Path, experts: ExpertEncoder) -> Path:
    """A copy of `hf_dir` whose fused experts hold the values `experts` stores for them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out_dir / f.name)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    for layer, (gate, up, down) in _split_experts(tensors):
        gate, up, down = (
            _decoded(experts(layer, proj, w))
            for proj, w in zip(EXPERT_PROJECTIONS, (gate, up, down), strict=True)
        )
        fused = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.float32)
        fused[:, 0::2], fused[:, 1::2] = gate, up  # [E, 2I, H], rows interleaved
        tensors[f"{layer}.gate_up_proj"] = torch.from_numpy(fused.transpose(0, 2, 1).copy())
        tensors[f"{layer}.down_proj"] = torch.from_numpy(down.transpose(0, 2, 1).copy())
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def random_mxfp4(seed: int, exponents: tuple[int, int] = (118, 127)) -> ExpertEncoder:
    """Seeded random MXFP4 blocks for every merged expert tensor, whatever its float values:
    random codes, exponents in [exponents) (E8M0: scale 2^(e - 127)). Every such block is a
    valid weight; the same (layer, projection) always gets the same bytes."""

    def encode(layer: str, proj: str, stacked: np.ndarray) -> tuple[np.ndarray, QType]:
        experts, rows, cols = stacked.shape
        rng = np.random.default_rng([seed, zlib.crc32(f"{layer}.{proj}".encode())])
        blocks = rng.integers(0, 256, (experts, rows, cols // MXFP4_BLOCK, MXFP4_BYTES), np.uint8)
        blocks[..., 0] = rng.integers(*exponents, blocks.shape[:-1], np.uint8)
        return blocks.reshape(experts, rows, -1), QType.MXFP4

    return encode


def gpt_oss_metadata(config: dict) -> dict[str, tuple[Any, VType]]:
    """The `gpt-oss.*` metadata the converter writes for `config` (config.json), by key."""
    llm, attention, rope = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope
    u32, f32 = VType.UINT32, VType.FLOAT32
    params = config.get("rope_parameters") or {
        "rope_theta": config["rope_theta"],
        **config["rope_scaling"],
    }
    metadata = {
        llm.CONTEXT_LENGTH: (config["max_position_embeddings"], u32),
        llm.EMBEDDING_LENGTH: (config["hidden_size"], u32),
        llm.BLOCK_COUNT: (config["num_hidden_layers"], u32),
        llm.FEED_FORWARD_LENGTH: (config["intermediate_size"], u32),
        llm.EXPERT_FEED_FORWARD_LENGTH: (config["intermediate_size"], u32),
        llm.EXPERT_COUNT: (config["num_local_experts"], u32),
        llm.EXPERT_USED_COUNT: (config["num_experts_per_tok"], u32),
        attention.HEAD_COUNT: (config["num_attention_heads"], u32),
        attention.HEAD_COUNT_KV: (config["num_key_value_heads"], u32),
        attention.KEY_LENGTH: (config["head_dim"], u32),
        attention.VALUE_LENGTH: (config["head_dim"], u32),
        attention.LAYERNORM_RMS_EPS: (config["rms_norm_eps"], f32),
        attention.SLIDING_WINDOW: (config["sliding_window"], u32),
        rope.FREQ_BASE: (params["rope_theta"], f32),
        rope.SCALING_TYPE: (params["rope_type"], VType.STRING),
        rope.SCALING_FACTOR: (params["factor"], f32),
        rope.SCALING_ORIG_CTX_LEN: (params["original_max_position_embeddings"], u32),
        rope.SCALING_YARN_BETA_FAST: (params.get("beta_fast", 32.0), f32),
        rope.SCALING_YARN_BETA_SLOW: (params.get("beta_slow", 1.0), f32),
    }
    found = {key.format(arch=ARCH): value for key, value in metadata.items()}
    found[gguf.Keys.Tokenizer.EOS_ID] = (config["eos_token_id"], u32)
    found[gguf.Keys.Tokenizer.BOS_ID] = (config["bos_token_id"], u32)
    return found


def _llama_cpp_layer_types(layers: int) -> list[str]:
    """llama.cpp's gpt-oss layers (sliding pattern 2): even ones slide."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _split_experts(tensors: dict) -> Iterator[tuple[str, tuple[np.ndarray, ...]]]:
    """(layer's experts prefix, (gate [E, I, H], up [E, I, H], down [E, H, I])) per layer, as
    the converter splits the fused tensors."""
    for name in sorted(tensors):
        if name.endswith(f"{_EXPERTS}.gate_up_proj"):
            layer = name.removesuffix(".gate_up_proj")
            rows = tensors[name].float().numpy().transpose(0, 2, 1)  # [E, 2I, H]
            down = tensors[f"{layer}.down_proj"].float().numpy().transpose(0, 2, 1)  # [E, H, I]
            yield layer, (rows[:, 0::2].copy(), rows[:, 1::2].copy(), down.copy())


def _decoded(encoded: tuple[np.ndarray, QType]) -> np.ndarray:
    stored, qtype = encoded
    return gguf.quants.dequantize(stored, qtype).astype(np.float32)


def _gguf_tensors(config: dict, tensors: dict, encoder: ExpertEncoder):
    """(GGUF name, data, ggml type) of every tensor, in the converter's naming."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config["num_hidden_layers"])
    for name, value in tensors.items():
        if f"{_EXPERTS}." in name and not name.endswith("_bias"):
            continue
        data = value.float().numpy()
        if name.endswith(".sinks"):
            yield f"{names.get_name(name)}.weight", data, QType.F32
        elif name.endswith(f"{_EXPERTS}.gate_up_proj_bias"):
            layer = name.removesuffix(".gate_up_proj_bias")
            for proj, part in (("gate_proj", data[:, 0::2]), ("up_proj", data[:, 1::2])):
                yield f"{names.get_name(f'{layer}.{proj}')}.bias", part.copy(), QType.F32
        elif name.endswith(f"{_EXPERTS}.down_proj_bias"):
            yield f"{names.get_name(name.removesuffix('_bias'))}.bias", data, QType.F32
        else:
            base, suffix = name.rsplit(".", 1)
            yield f"{names.get_name(base)}.{suffix}", data, QType.F32
    for layer, projections in _split_experts(tensors):
        for proj, stacked in zip(EXPERT_PROJECTIONS, projections, strict=True):
            data, qtype = encoder(layer, proj, stacked)
            yield f"{names.get_name(f'{layer}.{proj}')}.weight", data, qtype
