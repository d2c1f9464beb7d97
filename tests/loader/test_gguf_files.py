"""Opening GGUF files: bad files give one-line errors naming the problem, split sets load like
one file, our name table agrees with gguf-py's, and GGUF's Q8_0/Q4_0 bytes are our formats'."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_checkpoints import _MODEL_ARCH, GGUF_ARCH, write_gguf
from hf_checkpoints import PROMPT_IDS, VARIANTS, write_hf_checkpoint
from hybridmoe.errors import CheckpointError
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.models.gguf_names import gguf_name_map
from hybridmoe.models.loading import load_model
from hybridmoe.models.registry import MODEL_REGISTRY
from hybridmoe.quant.formats import WEIGHT_FORMATS


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    hf = write_hf_checkpoint("qwen3_moe", "mha_tied_top1", root / "hf")
    return write_gguf(hf, root / "model.gguf", "Q8_0")


def _cli_error(path: Path) -> str:
    """What `hybridmoe generate --model path` prints: one line, no traceback."""
    run = subprocess.run(
        [sys.executable, "-m", "hybridmoe", "generate", "--model", str(path), "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("hybridmoe: error")]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    return lines[0]


def _variant(good: Path, tmp_path: Path, edit) -> Path:
    data = bytearray(good.read_bytes())
    path = tmp_path / "bad.gguf"
    path.write_bytes(edit(data))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d[: len(d) // 2], "truncated or corrupt GGUF"),
        (lambda d: d[:6], "truncated GGUF file"),
        (lambda d: b"GGML" + d[4:], "not a GGUF file"),
        (lambda d: d[:4] + (7).to_bytes(4, "little") + d[8:], "GGUF version 7 is not supported"),
    ],
    ids=["truncated", "truncated-header", "magic", "version"],
)
def test_bad_file_is_one_line_error(good: Path, tmp_path: Path, edit, message: str) -> None:
    path = _variant(good, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        GgufFile(path)
    assert message in _cli_error(path)


def _rewrite(good: Path, path: Path, drop_key: str | None = None, retype: dict | None = None):
    """`good` rewritten with metadata key `drop_key` left out and tensors retyped
    (name -> ggml type: the bytes given as that type)."""
    reader = gguf.GGUFReader(good)
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", drop_key):
            continue
        value = field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    for tensor in reader.tensors:
        qtype = (retype or {}).get(tensor.name, tensor.tensor_type)
        data = np.asarray(tensor.data)
        if qtype != tensor.tensor_type:  # bytes of the same count, reinterpreted
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            data = np.zeros((*data.shape[:-1], tensor.shape[0] // block * size), np.uint8)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_metadata_key_is_named(good: Path, tmp_path: Path) -> None:
    path = _rewrite(good, tmp_path / "m.gguf", drop_key="qwen3moe.expert_used_count")
    with pytest.raises(CheckpointError, match="metadata key 'qwen3moe.expert_used_count' is miss"):
        load_model(path)
    assert "'qwen3moe.expert_used_count' is missing" in _cli_error(path)


def test_unsupported_expert_type_is_named(good: Path, tmp_path: Path) -> None:
    unsupported = next(
        t for t in (gguf.GGMLQuantizationType.IQ4_NL, gguf.GGMLQuantizationType.Q5_0)
        if t.name.lower() not in WEIGHT_FORMATS
    )  # fmt: skip
    names = [f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up", "down")]
    path = _rewrite(good, tmp_path / "m.gguf", retype=dict.fromkeys(names, unsupported))
    message = f"tensor 'blk.0.ffn_gate_exps.weight' has type {unsupported.name}"
    with pytest.raises(CheckpointError, match=message):
        load_model(path)
    assert message in _cli_error(path)


def _split(good: Path, directory: Path, parts: int) -> Path:
    """`good` as a split set `model-0000i-of-0000n.gguf` (metadata in the first part)."""
    reader = gguf.GGUFReader(good)
    arch = reader.fields["general.architecture"].contents()
    per_part = -(-len(reader.tensors) // parts)
    directory.mkdir()
    for i in range(parts):
        writer = gguf.GGUFWriter(str(directory / f"model-{i + 1:05d}-of-{parts:05d}.gguf"), arch)
        if i == 0:
            for name, field in reader.fields.items():
                if name.startswith("GGUF.") or name == "general.architecture":
                    continue
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
            writer.add_uint16("split.count", parts)
            writer.add_int32("split.tensors.count", len(reader.tensors))
        writer.add_uint16("split.no", i)
        writer.add_uint16("split.count", parts) if i else None
        for tensor in reader.tensors[i * per_part : (i + 1) * per_part]:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return directory / f"model-00001-of-{parts:05d}.gguf"


def test_split_set_loads_like_one_file_and_a_missing_part_is_named(good, tmp_path) -> None:
    first = _split(good, tmp_path / "split", 3)
    expected = load_model(good).logits(PROMPT_IDS)
    torch.testing.assert_close(load_model(first).logits(PROMPT_IDS), expected, atol=0, rtol=0)
    torch.testing.assert_close(load_model(first.parent).logits(PROMPT_IDS), expected)
    (first.parent / "model-00002-of-00003.gguf").unlink()
    with pytest.raises(CheckpointError, match="missing model-00002-of-00003.gguf"):
        GgufFile(first)
    assert "missing model-00002-of-00003.gguf" in _cli_error(first)


def test_directory_with_two_models_is_refused(good: Path, tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(good, tmp_path / name)
    with pytest.raises(CheckpointError, match="expected one GGUF model, found a.gguf, b.gguf"):
        GgufFile(tmp_path)


@pytest.mark.parametrize("family", sorted({f for f, _ in VARIANTS if f in GGUF_ARCH}))
def test_name_map_agrees_with_gguf_py(family: str) -> None:
    """Every checkpoint name of the family maps to what gguf-py's TensorNameMap calls it."""
    hf_family = next(
        f for f in MODEL_REGISTRY.values() if f.gguf and f.gguf.architecture == GGUF_ARCH[family]
    )
    ours = gguf_name_map(hf_family.weights.moe_prefix, hf_family.weights.expert_names)
    theirs = gguf.get_tensor_name_map(_MODEL_ARCH[GGUF_ARCH[family]], 4)
    moe = hf_family.weights.moe_prefix
    parts = ["input_layernorm", "post_attention_layernorm", f"{moe}.gate"]
    parts += [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    parts += [f"{moe}.experts.{n}" for n in hf_family.weights.expert_names]
    if family in ("qwen3_moe", "olmoe"):
        parts += ["self_attn.q_norm", "self_attn.k_norm"]
    if family == "qwen2_moe":
        parts += [f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        parts += ["mlp.shared_expert_gate"]
    names = [f"model.layers.3.{p}" for p in parts] + ["model.embed_tokens", "model.norm", "lm_head"]
    for name in names:
        assert ours(f"{name}.weight") == f"{theirs.get_name(name)}.weight", name


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "mxfp4"])
def test_gguf_blocks_are_our_formats_bytes(name: str) -> None:
    """gguf-py's quantiser writes the bytes our format's quantiser writes, and each side's
    dequantiser reads the other's bytes to the same values."""
    fmt, qtype = WEIGHT_FORMATS[name], gguf.GGMLQuantizationType[name.upper()]
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0)) * 3
    theirs = gguf.quants.quantize(w.numpy(), qtype)
    ours = fmt.quantize(w)
    assert np.array_equal(ours.numpy(), theirs)
    values = gguf.quants.dequantize(theirs, qtype)
    torch.testing.assert_close(fmt.dequantize(ours), torch.from_numpy(values), atol=0, rtol=0)
