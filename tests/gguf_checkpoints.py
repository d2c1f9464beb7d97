"""GGUF files written in the tests from Hugging Face checkpoints, as llama.cpp's converter
(convert_hf_to_gguf.py) writes them: its metadata keys, gguf-py's own tensor-name map
(`gguf.get_tensor_name_map`, deliberately not hybridmoe's table), each layer's experts merged
into `blk.N.ffn_{gate,up,down}_exps`, and llama-arch (Mixtral) q/k rows permuted for
llama.cpp's rotary layout. Nothing is downloaded.

`write_dequantized_checkpoint` gives the float checkpoint a quantised GGUF stands for (its
experts replaced by their dequantised values): the oracle transformers and our safetensors
loader run.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file

from hybridmoe.quant.formats import weight_format
from random_weights import random_stored

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe"}
_MODEL_ARCH = {
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
    "llama": gguf.MODEL_ARCH.LLAMA,
    "olmoe": gguf.MODEL_ARCH.OLMOE,
}
_EXPERT = re.compile(
    r"^(?P<layer>model\.layers\.\d+\.\w+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$"
)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4
# (a layer's experts prefix `model.layers.N.mlp.experts`, projection `gate_proj`, float
# [E, rows, cols]) -> (the stored bytes [E, rows, row bytes] uint8, their ggml type): how a
# test chooses each merged expert tensor's type and bytes (a Q4_K_M file's mix of types)
ExpertEncoder = Callable[[str, str, np.ndarray], tuple[np.ndarray, QType]]
# (a dense tensor's checkpoint name less `.weight`, e.g. `model.layers.0.self_attn.q_proj`,
# its float values) -> (the stored bytes, their ggml type), or None to store it F32: how a
# test stores dense projections quantised (a downloaded Q4_K_M file's attention and head)
DenseEncoder = Callable[[str, np.ndarray], "tuple[np.ndarray, QType] | None"]


def write_gguf(
    hf_dir: Path,
    path: Path,
    expert_type: str = "F32",
    tokenizer: dict | None = None,
    chat_template: str | None = None,
    experts: ExpertEncoder | None = None,
    dense: DenseEncoder | None = None,
) -> Path:
    """`hf_dir`'s model as a GGUF at `path`, experts in ggml type `expert_type` (or as
    `experts` encodes each merged tensor), dense tensors F32 (or as `dense` encodes each
    `.weight`: llama-arch q/k as the converter stores them, rows permuted).
    `tokenizer`: a tokenizer.json dict (with `pre`, the tokenizer.ggml.pre name, added); None:
    a byte-alphabet vocabulary of the model's size without merges."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    tensors = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    _add_metadata(writer, config, tensors)
    _add_tokenizer(writer, tokenizer, config)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    encoder = experts or _quantizer(QType[expert_type])
    for name, data, qtype in _gguf_tensors(arch, config, tensors, encoder, dense):
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_dequantized_checkpoint(hf_dir: Path, out_dir: Path, expert_type: str) -> Path:
    """A copy of `hf_dir` whose routed experts are what `expert_type` stores for them."""
    return write_encoded_checkpoint(hf_dir, out_dir, _quantizer(QType[expert_type]))


def write_encoded_checkpoint(
    hf_dir: Path,
    out_dir: Path,
    experts: ExpertEncoder | None = None,
    dense: DenseEncoder | None = None,
) -> Path:
    """A copy of `hf_dir` whose routed experts (and dense weights `dense` encodes) are the
    values `experts` (`dense`) stores for them, dequantised by gguf.quants: the float model a
    GGUF written with them stands for (`experts` None: kept, as write_gguf's F32)."""
    experts = experts or _quantizer(QType.F32)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out_dir / f.name)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    for (layer, proj), by_expert in _merged_experts(tensors).items():
        stacked = np.stack([by_expert[e].float().numpy() for e in sorted(by_expert)])
        stored, qtype = experts(layer, proj, stacked)
        values = torch.from_numpy(gguf.quants.dequantize(stored, qtype).copy())  # [E, rows, cols]
        for e in sorted(by_expert):
            tensors[f"{layer}.{e}.{proj}.weight"] = values[e].clone()
    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH.get(config["model_type"])  # None: a family written by its own test module
    for name, value in list(tensors.items()):
        found, base = None, name.removesuffix(".weight")
        if dense is not None and name.endswith(".weight") and not _EXPERT.match(name):
            found = dense(base, _permuted(arch, config, base, value.float().numpy()))
        if found is not None:  # what the file's rows stand for, in the checkpoint's order
            stored = gguf.quants.dequantize(found[0], found[1])
            stored = _permuted(arch, config, base, stored, inverse=True)
            tensors[name] = torch.from_numpy(stored.copy()).to(value.dtype)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def random_dense_encoder(types: dict[str, str]) -> DenseEncoder:
    """A DenseEncoder storing each projection named in `types` (its last name part: q_proj,
    lm_head, ...) in that ggml type: Q8_0 by gguf's quantiser, the k-quants (no quantiser) as
    seeded random blocks of about a float model's scale (std ~0.06, 1 / sqrt(256))."""

    def encode(base: str, value: np.ndarray) -> tuple[np.ndarray, QType] | None:
        type_name = types.get(base.rsplit(".", 1)[-1])
        if type_name is None:
            return None
        if type_name == "Q8_0":
            return gguf.quants.quantize(value, QType.Q8_0), QType.Q8_0
        gen = torch.Generator().manual_seed(zlib.crc32(base.encode()))
        stored = random_stored(weight_format(type_name.lower()), value.shape, gen, 0.25)
        return stored.numpy(), QType[type_name]

    return encode


# per file, per layer: the ggml type of gate, up and down of a 2-layer model (down gets more
# bits, as llama.cpp's Q4_K_M and Q2_K rules give it)
KQUANT_FILE_TYPES = {
    "q4_k_m": {0: ("Q4_K", "Q4_K", "Q6_K"), 1: ("Q4_K", "Q4_K", "Q5_K")},
    "q2_k": {0: ("Q2_K", "Q2_K", "Q3_K"), 1: ("Q3_K", "Q3_K", "Q3_K")},
}
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# a qwen3_moe config whose widths are one k-quant super-block (256), so every expert row is
# whole blocks
WIDE_QWEN3 = dict(
    hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
    intermediate_size=128, norm_topk_prob=True,
)  # fmt: skip


def random_kquants(types: dict[int, tuple[str, str, str]]) -> ExpertEncoder:
    """An ExpertEncoder storing each layer's projections as seeded random blocks of `types`
    (KQUANT_FILE_TYPES' layout; layer N takes types[N mod len(types)], the pattern repeated
    over a deeper model; finite scales, weights up to 0.08: of the float model's scale)."""

    def encode(layer: str, proj: str, stacked: np.ndarray) -> tuple[np.ndarray, QType]:
        layer_types = types[int(layer.split(".")[2]) % len(types)]
        type_name = layer_types[_PROJECTIONS.index(proj)]
        gen = torch.Generator().manual_seed(zlib.crc32(f"{layer}.{proj}".encode()))
        stored = random_stored(weight_format(type_name.lower()), stacked.shape, gen, 0.08)
        return stored.numpy(), QType[type_name]

    return encode


def _quantizer(qtype: QType) -> ExpertEncoder:
    """Every merged expert tensor quantised to `qtype` by gguf.quants (F32: kept)."""

    def encode(layer: str, proj: str, stacked: np.ndarray) -> tuple[np.ndarray, QType]:
        return (stacked if qtype == QType.F32 else gguf.quants.quantize(stacked, qtype)), qtype

    return encode


def _merged_experts(tensors: dict) -> dict[tuple[str, str], dict[int, torch.Tensor]]:
    """(layer's experts prefix, projection) -> expert index -> its matrix."""
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, value in tensors.items():
        found = _EXPERT.match(name)
        if found:
            experts.setdefault((found["layer"], found["proj"]), {})[int(found["e"])] = value
    return experts


def _rope(config: dict) -> dict:
    if "rope_parameters" in config:
        return dict(config["rope_parameters"])
    return {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {})}


def _add_metadata(writer: gguf.GGUFWriter, config: dict, tensors: dict) -> None:
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    experts = config.get("num_experts") or config.get("num_local_experts")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_vocab_size(config["vocab_size"])
    rope = _rope(config)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type", "default") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    model_type = config["model_type"]
    if model_type in ("qwen3_moe", "qwen2_moe"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if model_type == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if model_type != "mixtral":
        writer.add_expert_weights_norm(bool(config.get("norm_topk_prob")))
    if model_type == "olmoe" and config.get("clip_qkv") is not None:
        writer.add_clamp_kqv(config["clip_qkv"])
    if model_type == "mixtral" and config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    writer.add_eos_token_id(config["eos_token_id"])
    if config.get("bos_token_id") is not None:
        writer.add_bos_token_id(config["bos_token_id"])


def _add_tokenizer(
    writer: gguf.GGUFWriter, tokenizer: dict | None, config: dict, pre: str = "default"
) -> None:
    writer.add_tokenizer_model("gpt2")
    if tokenizer is None:
        alphabet = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 400)]
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(alphabet[: config["vocab_size"]])
        writer.add_token_types([TOKEN_NORMAL] * config["vocab_size"])
        writer.add_token_merges([])
        return
    tokens, types = tokenizer_vocab(tokenizer)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_pre(tokenizer["pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_add_bos_token(tokenizer.get("add_bos", False))


def tokenizer_vocab(tokenizer: dict) -> tuple[list[str], list[int]]:
    """Tokens by id and their llama.cpp types, as the converter derives them: added special
    tokens are CONTROL, other added tokens USER_DEFINED."""
    by_id = {i: t for t, i in tokenizer["model"]["vocab"].items()}
    types = dict.fromkeys(by_id, TOKEN_NORMAL)
    for added in tokenizer["added_tokens"]:
        by_id[added["id"]] = added["content"]
        types[added["id"]] = TOKEN_CONTROL if added["special"] else TOKEN_USER_DEFINED
    size = max(by_id) + 1
    return [by_id[i] for i in range(size)], [types[i] for i in range(size)]


def _gguf_tensors(
    arch: str, config: dict, tensors: dict, encoder: ExpertEncoder, dense: DenseEncoder | None
):
    """(GGUF name, data, ggml type) of every tensor, in the converter's naming."""
    layers = config["num_hidden_layers"]
    arch_names = gguf.get_tensor_name_map(_MODEL_ARCH[arch], layers)
    # llama.cpp's qwen archs have no dense layers; hybridmoe reads them (mlp_only_layers) under
    # the names llama's map gives a dense MLP
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)

    def gguf_name(base: str) -> str:
        return arch_names.get_name(base) or dense_names.get_name(base)

    for name, value in tensors.items():
        if _EXPERT.match(name):
            continue
        base, suffix = name.rsplit(".", 1)
        value = _permuted(arch, config, base, value.float().numpy())
        found = dense(base, value) if dense is not None and suffix == "weight" else None
        data, qtype = (value, QType.F32) if found is None else found
        yield f"{gguf_name(base)}.{suffix}", data, qtype
    for (layer, proj), by_expert in _merged_experts(tensors).items():
        stacked = np.stack([by_expert[e].float().numpy() for e in sorted(by_expert)])
        data, qtype = encoder(layer, proj, stacked)
        yield f"{gguf_name(f'{layer}.{proj}')}.weight", data, qtype


def _permuted(
    arch: str | None, config: dict, base: str, value: np.ndarray, inverse: bool = False
) -> np.ndarray:
    """llama.cpp's LlamaModel.permute of q/k rows (interleaved rotary pairs); `inverse`: its
    undoing (the stored rows back in the checkpoint's order)."""
    if arch != "llama" or not base.endswith(("q_proj", "k_proj")):
        return value
    heads = config["num_attention_heads"]
    if base.endswith("k_proj"):
        heads = config.get("num_key_value_heads") or heads
    rows = value.shape[0]
    split = (heads, rows // heads // 2, 2) if inverse else (heads, 2, rows // heads // 2)
    return value.reshape(*split, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)
