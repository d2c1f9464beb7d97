"""The checkpoints bench_vs_llamacpp.py compares on: a random Qwen3-MoE of a preset shape, written
once as safetensors (bench_decode.py's hub layout, bf16) and converted to one GGUF per expert
format, as llama.cpp's converter names and lays it out (qwen3moe metadata, gguf-py's tensor
names, each layer's experts merged into `blk.N.ffn_{gate,up,down}_exps`), the other matrices
bf16 (q4_k_m_all: in llama.cpp's Q4_K_M types, seeded random blocks as the k-quant experts),
and, as the converter keeps them, norms and routers F32 (llama.cpp's CPU ops multiply no
f32 by a bf16 norm); their values are the checkpoint's bf16 ones either way.

Quantised experts are hybridmoe's own quantiser's bytes (q8_0 / q4_0 blocks are ggml's layout,
tests/quant/test_gguf_layout.py), so both engines read the same bytes from the same file.
k-quant experts (q2_k ... q6_k; q4_k_m: llama.cpp's Q4_K_M mix, EXPERT_MIXES) have no
quantiser: they are seeded random blocks with finite scales (hybridmoe.quant.random_blocks;
weights std about 0.02 like the checkpoint's, so the hidden states stay finite), the same bytes
for a tensor of a type in every file; such a file stands for its own model, not the checkpoint's.
Tensors are streamed to the file one at a time (a 30B-shaped layer's experts are 1.2 GB).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import gguf
import numpy as np
import torch
from bench_decode import Qwen3MoeShape, ensure_checkpoint
from gguf import GGMLQuantizationType as QType
from safetensors import safe_open

from hybridmoe.quant.formats import weight_format
from hybridmoe.quant.random_blocks import random_stored

SHAPES = {
    # Qwen3-30B-A3B's layer (issue 14): ~4.9 GB bf16 for 4 layers
    "qwen3-30b-a3b-4l": Qwen3MoeShape(
        vocab_size=4096, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    # Qwen3-30B-A3B's expert layer with a narrow attention (2 heads of 64) and vocabulary (512):
    # ~90 % of a token's bytes are experts, so tok/s compares the engines' MoE layers
    "qwen3-30b-a3b-moe": Qwen3MoeShape(
        vocab_size=512, hidden_size=2048, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    # ~1.0 GB bf16
    "1gb": Qwen3MoeShape(
        vocab_size=4096, hidden_size=1024, num_hidden_layers=5, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
        moe_intermediate_size=512,
    ),
    # for tests: rows are whole 32-weight blocks
    "tiny": Qwen3MoeShape(
        vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
    # for tests of the k-quants: rows are whole 256-weight super-blocks
    "tiny-k": Qwen3MoeShape(
        vocab_size=320, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=256,
    ),
}  # fmt: skip
EXPERT_TYPES = {
    "bf16": QType.BF16, "q8_0": QType.Q8_0, "q4_0": QType.Q4_0,
    "q2_k": QType.Q2_K, "q3_k": QType.Q3_K, "q4_k": QType.Q4_K, "q5_k": QType.Q5_K,
    "q6_k": QType.Q6_K,
}  # fmt: skip
QUANTISED = ("q8_0", "q4_0")  # expert formats hybridmoe quantises from the checkpoint
RANDOM_MAX_ABS = 0.08  # k-quant blocks' largest |weight|: std about 0.02, the checkpoint's
# q4_k_m: the rule for the experts only, dense tensors bf16 (as every other file here);
# q4_k_m_all: for every tensor, as a downloaded Q4_K_M file (dense_type)
EXPERT_MIXES = ("q4_k_m", "q4_k_m_all")
EXPERT_FORMATS = (*EXPERT_TYPES, *EXPERT_MIXES)


def expert_type(expert_format: str, layer: int, proj: str, layers: int) -> QType:
    """The ggml type of layer `layer`'s merged `proj` experts (gate_proj, up_proj, down_proj)
    in a file of `expert_format`. q4_k_m and q4_k_m_all: llama.cpp's Q4_K_M rule for expert
    tensors (llama_tensor_get_type): ffn_down Q6_K in the layers use_more_bits picks
    (_more_bits), else Q4_K; gate and up Q4_K (dense tensors: dense_type)."""
    if expert_format in EXPERT_TYPES:
        return EXPERT_TYPES[expert_format]
    if expert_format not in EXPERT_MIXES:
        raise ValueError(f"expert format {expert_format!r}: one of {', '.join(EXPERT_FORMATS)}")
    return QType.Q6_K if proj == "down_proj" and _more_bits(layer, layers) else QType.Q4_K


def dense_type(expert_format: str, base: str, layers: int) -> QType:
    """The ggml type of the dense tensor `base` (a checkpoint name less `.weight`) in a file of
    `expert_format`: F32 for vectors and the router (as the converter keeps them), bf16 but
    in q4_k_m_all, which follows llama.cpp's Q4_K_M rule (llama_tensor_get_type): the output
    head and attn_v in the layers _more_bits picks Q6_K, every other matrix (q, k, o, the
    other attn_v, the embeddings) Q4_K."""
    if base.endswith(("norm", "mlp.gate")):
        return QType.F32
    if expert_format != "q4_k_m_all":
        return QType.BF16
    if base == "lm_head":
        return QType.Q6_K
    if base.endswith("v_proj") and _more_bits(int(base.split(".")[2]), layers):
        return QType.Q6_K
    return QType.Q4_K


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third
    between (i < n/8, i >= 7n/8, (i - n/8) % 3 == 2)."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def checkpoint_bytes(shape: Qwen3MoeShape) -> int:
    return 2 * shape.total_params


def ensure_files(shape_name: str, root: Path, formats: tuple[str, ...]) -> dict[str, Path]:
    """The safetensors checkpoint (key "safetensors") and one GGUF per expert format under
    `root/shape_name`, each written only when missing."""
    shape = SHAPES[shape_name]
    directory = ensure_checkpoint(shape, root / shape_name / "safetensors")
    files = {"safetensors": directory}
    for fmt in formats:
        path = root / shape_name / f"model-{fmt}.gguf"
        if not path.exists():
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # one per run
            write_gguf(directory, partial, fmt)
            partial.rename(path)
        files[fmt] = path
    return files


def write_gguf(checkpoint_dir: Path, path: Path, expert_format: str) -> Path:
    """`checkpoint_dir`'s model as a GGUF at `path`: experts in `expert_format`
    (EXPERT_FORMATS; k-quants: random blocks), dense tensors as dense_type says."""
    expert_type(expert_format, 0, "down_proj", 1)  # a bad format is refused before writing
    config = json.loads((checkpoint_dir / "config.json").read_text())
    shape = Qwen3MoeShape(**{k: config[k] for k in Qwen3MoeShape.__dataclass_fields__})
    reader = _TensorReader(checkpoint_dir)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    _add_metadata(writer, config)
    _add_tokenizer(writer, shape.vocab_size)
    plan = list(_tensor_plan(shape, expert_format))
    for gguf_name, dims, qtype, _ in plan:
        byte_dims = _byte_dims(gguf_name, dims, qtype)
        writer.add_tensor_info(gguf_name, byte_dims, np.uint8, math.prod(byte_dims), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, qtype, source in plan:
        writer.write_tensor_data(_stored(reader, source, qtype))
    writer.close()
    return path


def _tensor_plan(shape: Qwen3MoeShape, expert_format: str):
    """(GGUF name, logical dims, ggml type, source) in file order; source: a checkpoint name, or
    (layer prefix, proj) for a merged expert tensor."""
    layers = shape.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, layers)
    experts: dict[tuple[str, str], tuple[int, ...]] = {}
    for name, dims in shape.tensor_shapes().items():
        if ".experts." in name:
            prefix, rest = name.split(".experts.")
            experts[(prefix + ".experts", rest.split(".")[1])] = dims
            continue
        base = name.removesuffix(".weight")
        qtype = QType.F32 if len(dims) == 1 else dense_type(expert_format, base, layers)
        yield f"{names.get_name(base)}.weight", dims, qtype, name
    for (prefix, proj), dims in experts.items():
        gguf_name = f"{names.get_name(f'{prefix}.{proj}')}.weight"
        source = (prefix, proj, shape.num_experts)
        layer = int(prefix.split(".")[2])  # model.layers.N.mlp.experts
        qtype = expert_type(expert_format, layer, proj, shape.num_hidden_layers)
        yield gguf_name, (shape.num_experts, *dims), qtype, source


def _byte_dims(name: str, dims: tuple[int, ...], qtype: QType) -> tuple[int, ...]:
    """The stored shape in bytes: rows of blocks (bf16, f32: blocks of one value)."""
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if dims[-1] % block:
        raise ValueError(f"{name}: rows of {dims[-1]} weights are not whole {qtype.name} blocks")
    return (*dims[:-1], dims[-1] // block * type_bytes)


def _stored(reader: _TensorReader, source, qtype: QType) -> np.ndarray:
    """The bytes of one GGUF tensor (uint8; rows of bf16 values or of quantised blocks)."""
    if isinstance(source, str) and qtype not in (QType.F32, QType.BF16):  # q4_k_m_all's
        dims = tuple(reader.shape(source))
        gen = torch.Generator().manual_seed(zlib.crc32(f"{source}:{qtype.name}".encode()))
        fmt = weight_format(qtype.name.lower())
        return random_stored(fmt, dims, gen, RANDOM_MAX_ABS).numpy()
    if isinstance(source, str):  # dense: F32 or BF16
        value = reader.get(source)
        value = value.float() if qtype == QType.F32 else value.to(torch.bfloat16)
        return value.contiguous().view(torch.uint8).numpy()
    fmt = weight_format(qtype.name.lower())
    if fmt.name not in ("bf16", *QUANTISED):
        return _random_experts(reader, source, fmt)
    prefix, proj, count = source
    value = torch.stack([reader.get(f"{prefix}.{e}.{proj}.weight") for e in range(count)])
    if fmt.name == "bf16":
        return value.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
    return fmt.quantize(value.float()).numpy()  # [E, rows, row_bytes]


def _random_experts(reader: _TensorReader, source, fmt) -> np.ndarray:
    """Seeded random blocks of `fmt` [E, rows, row_bytes] for the merged experts `source`
    (one expert at a time; the seed names the tensor and type, not the file)."""
    prefix, proj, count = source
    dims = tuple(reader.shape(f"{prefix}.0.{proj}.weight"))  # [rows, n]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{prefix}.{proj}:{fmt.name}".encode()))
    experts = [random_stored(fmt, dims, gen, RANDOM_MAX_ABS) for _ in range(count)]
    return torch.stack(experts).numpy()


class _TensorReader:
    """Tensors of a (sharded) safetensors checkpoint by name."""

    def __init__(self, directory: Path):
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        self.directory, self.weight_map = directory, index["weight_map"]

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.directory / self.weight_map[name], framework="pt") as f:
            return f.get_tensor(name)

    def shape(self, name: str) -> list[int]:
        with safe_open(self.directory / self.weight_map[name], framework="pt") as f:
            return f.get_slice(name).get_shape()


def _add_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    head_dim = config["head_dim"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_weights_norm(bool(config["norm_topk_prob"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)


def _add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A byte-level BPE vocabulary: the 256 byte symbols, then pairs of them with their merges
    (both engines are fed token ids; the vocabulary only has to be valid)."""
    alphabet = [_byte_symbol(b) for b in range(256)]
    if vocab_size < len(alphabet):
        raise ValueError(f"vocab_size {vocab_size} < 256: the byte alphabet does not fit")
    pairs = [(a, b) for a in alphabet[33:127] for b in alphabet[33:127]]
    extra = pairs[: vocab_size - len(alphabet)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(alphabet + [a + b for a, b in extra])
    writer.add_token_types([1] * vocab_size)  # NORMAL
    writer.add_token_merges([f"{a} {b}" for a, b in extra])


def _byte_symbol(byte: int) -> str:
    """GPT-2's printable stand-in for a byte (bytes_to_unicode)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if byte in printable:
        return chr(byte)
    return chr(256 + sum(1 for b in range(byte) if b not in printable))


def bytes_read_per_token(path: Path) -> int:
    """Weight bytes one decode token reads from the GGUF at `path`: every dense tensor, the
    routed share (top-k / experts) of each merged expert tensor, one embedding row."""
    reader = gguf.GGUFReader(path)
    experts = int(reader.fields["qwen3moe.expert_count"].contents())
    used = int(reader.fields["qwen3moe.expert_used_count"].contents())
    total = 0
    for tensor in reader.tensors:
        if tensor.name.endswith("_exps.weight"):
            total += int(tensor.n_bytes) * used // experts
        elif tensor.name == "token_embd.weight":
            total += int(tensor.n_bytes) // int(tensor.shape[-1])  # GGUF dims: [H, V]
        else:
            total += int(tensor.n_bytes)
    return total
