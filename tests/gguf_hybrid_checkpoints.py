"""GGUF files of the hybrid linear-attention families, Qwen3-Next (`qwen3next`) and Qwen3.5-MoE
(`qwen35moe`), written in the tests from their transformers checkpoints as llama.cpp's converter
(its Qwen3NextModel, and the V-head reordering subclass Qwen3.5 converts through) writes them,
in this test's own code: the ssm.* metadata; A_log stored as -exp(A_log), dt_bias as
ssm_dt.bias, conv1d squeezed, (1 + w) norms as 1 + w; Qwen3-Next's in_proj_qkvz split into
attn_qkv and attn_gate; Qwen3.5's value-head axes reordered from grouped by key head to tiled.
Dense tensors in `dense_type` as the converter stores them: 1-D ones, the router and the conv
in F32. The other families' writer, whose helpers this one shares: tests/gguf_checkpoints.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file

from gguf_checkpoints import (
    _EXPERT,
    ExpertEncoder,
    _add_tokenizer,
    _merged_experts,
    _quantizer,
    _rope,
    write_encoded_checkpoint,
)

HYBRID_ARCH = {"qwen3_next": "qwen3next", "qwen3_5_moe_text": "qwen35moe"}
_HYBRID_MODEL_ARCH = {
    "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT,
    "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE,
}
_HYBRID_PRE = {"qwen3next": "qwen2", "qwen35moe": "qwen35"}  # tokenizer.ggml.pre of the families
_KEPT_F32 = ("mlp.gate.weight", "conv1d.weight")  # the converter keeps these in F32


def write_hybrid_gguf(
    hf_dir: Path,
    path: Path,
    dense_type: str = "F32",
    experts: ExpertEncoder | None = None,
    mtp_layers: int = 0,
    chat_template: str | None = None,
    drop_keys: tuple[str, ...] = (),
) -> Path:
    """`hf_dir`'s Qwen3-Next / Qwen3.5-MoE model as a GGUF at `path`: experts as `experts`
    encodes them (None: F32); `mtp_layers` random multi-token-prediction blocks appended after
    the text layers (`nextn_predict_layers`), as the converter writes Qwen3.5's; the metadata
    keys `drop_keys` left out (a broken file)."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = HYBRID_ARCH[config["model_type"]]
    tensors = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    _add_hybrid_metadata(writer, arch, config, mtp_layers)
    for key in drop_keys:
        del writer.kv_data[0][key]
    _add_tokenizer(writer, None, config, _HYBRID_PRE[arch])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    encoder = experts or _quantizer(QType.F32)
    for name, data, qtype in _hybrid_tensors(arch, config, tensors, dense_type, encoder):
        writer.add_tensor(name, data, raw_dtype=qtype)
    gen = torch.Generator().manual_seed(mtp_layers)
    for i in range(config["num_hidden_layers"], config["num_hidden_layers"] + mtp_layers):
        hidden = config["hidden_size"]
        writer.add_tensor(f"blk.{i}.attn_norm.weight", torch.rand(hidden, generator=gen).numpy())
        eh_proj = torch.randn(hidden, 2 * hidden, generator=gen).numpy()
        writer.add_tensor(f"blk.{i}.nextn.eh_proj.weight", eh_proj)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_hybrid_reference(
    hf_dir: Path, out_dir: Path, dense_type: str = "F32", experts: ExpertEncoder | None = None
) -> Path:
    """A copy of `hf_dir` holding the values write_hybrid_gguf's file stands for: each tensor
    through what the file stores and back (A_log -> -exp -> log, w -> 1 + w -> - 1, bf16
    rounding; experts dequantised): the float model transformers runs as the oracle."""
    write_encoded_checkpoint(hf_dir, out_dir, experts or _quantizer(QType.F32))
    tensors = load_file(str(out_dir / "model.safetensors"))
    for name, value in tensors.items():
        if not _EXPERT.match(name):
            tensors[name] = _round_trip(name, value.float(), dense_type)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _round_trip(name: str, x: torch.Tensor, dense_type: str) -> torch.Tensor:
    if name.endswith(".A_log"):
        stored = -x.exp()  # ssm_a
        return (-stored).log()
    if _is_offset_norm(name):
        return (x + 1) - 1
    qtype = _stored_type(name, x, dense_type)
    if qtype is not None:
        stored = gguf.quants.quantize(x.numpy(), qtype)
        return torch.from_numpy(gguf.quants.dequantize(stored, qtype).copy())
    return x


def _stored_type(name: str, x: torch.Tensor, dense_type: str) -> QType | None:
    """The ggml type a dense tensor is stored in, None for F32: `dense_type` for a matrix
    whose rows are whole blocks of it (the converter keeps others as they are)."""
    if x.ndim < 2 or dense_type == "F32" or name.endswith(_KEPT_F32):
        return None
    qtype = QType[dense_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if x.shape[-1] % block == 0 else None


def _is_offset_norm(name: str) -> bool:
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def _add_hybrid_metadata(writer: gguf.GGUFWriter, arch: str, config: dict, mtp: int) -> None:
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    layers, interval = config["num_hidden_layers"], _full_attention_interval(config)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers + mtp)
    if mtp:
        writer.add_nextn_predict_layers(mtp)
    if config.get("intermediate_size"):
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_vocab_size(config["vocab_size"])
    rope = _rope(config)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch == "qwen35moe":  # interleaved MRoPE sections, as the converter always writes them
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    writer.add_full_attention_interval(interval)
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_bos_token_id(config["bos_token_id"])


def _full_attention_interval(config: dict) -> int:
    """The interval the converter writes (it reads `full_attention_interval`, default 4; the
    saved config.json has `layer_types`: they must agree, or the file is another model)."""
    interval = config.get("full_attention_interval", 4)
    expected = [(i + 1) % interval != 0 for i in range(config["num_hidden_layers"])]
    actual = [t == "linear_attention" for t in config.get("layer_types", [])] or expected
    assert actual == expected, f"layer_types {config['layer_types']} are not every {interval}th"
    return interval


def _hybrid_tensors(arch: str, config: dict, tensors: dict, dense_type: str, encoder):
    """(GGUF name, data, ggml type) of every tensor, converted as the converter does."""
    layers = config["num_hidden_layers"]
    arch_names = gguf.get_tensor_name_map(_HYBRID_MODEL_ARCH[arch], layers)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)  # dense MLP layers

    def gguf_name(name: str) -> str:
        suffixes = (".weight", ".bias")
        found = arch_names.get_name(name, try_suffixes=suffixes)
        return found or dense_names.get_name(name, try_suffixes=suffixes)

    for name, value in tensors.items():
        if _EXPERT.match(name):
            continue
        for part_name, part in _converted(arch, config, name, value.float()):
            data, qtype = part.numpy(), _stored_type(name, part, dense_type)
            if qtype is None:
                qtype = QType.F32
            else:
                data = gguf.quants.quantize(data, qtype)
            yield gguf_name(part_name), data, qtype
    for (layer, proj), by_expert in _merged_experts(tensors).items():
        stacked = np.stack([by_expert[e].float().numpy() for e in sorted(by_expert)])
        data, qtype = encoder(layer, proj, stacked)
        yield f"{gguf_name(f'{layer}.{proj}')}.weight", data, qtype


def _converted(arch: str, config: dict, name: str, x: torch.Tensor):
    """[(checkpoint-style name, tensor)] the converter makes of checkpoint tensor `name`."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if arch == "qwen35moe" and k_heads != v_heads and ".linear_attn." in name:
        x = _tiled_value_heads(name, x, config)
    if name.endswith(".A_log"):
        x = -x.exp()
    elif name.endswith(".dt_bias"):
        name = name.removesuffix("dt_bias") + "dt_proj.bias"
    elif "conv1d" in name:
        x = x.squeeze()
    elif _is_offset_norm(name):
        x = x + 1
    if not name.endswith("in_proj_qkvz.weight"):
        return [(name, x)]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    per_head = x.reshape(k_heads, -1, x.shape[-1])  # [key heads, q k v z of the head, H]
    q, k, v, z = per_head.split([dk, dk, v_heads // k_heads * dv, v_heads // k_heads * dv], 1)
    qkv = torch.cat([t.reshape(-1, x.shape[-1]) for t in (q, k, v)])
    base = name.removesuffix("in_proj_qkvz.weight")
    return [
        (f"{base}in_proj_qkv.weight", qkv),
        (f"{base}in_proj_z.weight", z.reshape(-1, x.shape[-1])),
    ]


def _tiled_value_heads(name: str, x: torch.Tensor, config: dict) -> torch.Tensor:
    """Qwen3.5's value-head axes from grouped by key head to tiled (the converter's
    `_reorder_v_heads`)."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dv, key_dim = config["linear_value_head_dim"], k_heads * config["linear_key_head_dim"]

    def tiled(t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        split = (*t.shape[:dim], k_heads, v_heads // k_heads, head_dim, *t.shape[dim + 1 :])
        return t.reshape(split).transpose(dim, dim + 1).reshape(t.shape)

    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return torch.cat([x[: 2 * key_dim], tiled(x[2 * key_dim :], 0, dv)])
    if name.endswith("in_proj_z.weight"):
        return tiled(x, 0, dv)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return tiled(x, 0, 1)
    if name.endswith("out_proj.weight"):
        return tiled(x, 1, dv)
    return x
