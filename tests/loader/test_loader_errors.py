"""Loading checkpoints: every broken file or unsupported config field is refused with an error
that names it; sharded checkpoints, memory mapping and bfloat16 loads work."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridmoe.engine import Engine, EngineConfig
from hybridmoe.errors import CheckpointError, UnsupportedConfigError
from hybridmoe.loader.weights import INDEX_FILE
from hybridmoe.models.loading import load_model
from safetensors_layout import tensor_offsets_mod_64

WEIGHTS_FILE = "model.safetensors"
EXPERT_TENSOR = "model.layers.2.mlp.experts.5.up_proj.weight"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n"


def with_weights(
    demo_checkpoint: Path,
    demo_variant: Callable[..., Path],
    edit: Callable[[dict[str, torch.Tensor]], None],
) -> Path:
    """A demo variant whose model.safetensors holds the demo's weights after `edit`."""
    directory = demo_variant(skip=(WEIGHTS_FILE,))
    weights = load_file(str(demo_checkpoint / WEIGHTS_FILE))
    edit(weights)
    save_file(weights, str(directory / WEIGHTS_FILE))
    return directory


def checkpoint_error(directory: Path) -> str:
    """The message of the CheckpointError (not a subclass) that loading `directory` raises."""
    with pytest.raises(CheckpointError) as info:
        load_model(directory)
    assert info.type is CheckpointError, f"expected a plain CheckpointError, got {info.value!r}"
    return str(info.value)


# --- files ----------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    assert str(missing) in checkpoint_error(missing)


def test_missing_config(demo_variant):
    directory = demo_variant(skip=("config.json",))
    assert str(directory / "config.json") in checkpoint_error(directory)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_config_not_a_json_object(demo_variant, text):
    directory = demo_variant(skip=("config.json",))
    (directory / "config.json").write_text(text)
    assert str(directory / "config.json") in checkpoint_error(directory)


def test_no_weight_files(demo_variant):
    directory = demo_variant(skip=(WEIGHTS_FILE,))
    message = checkpoint_error(directory)
    assert str(directory) in message and "*.safetensors" in message


def test_index_names_missing_shard(demo_variant):
    directory = demo_variant()
    weight_map = {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    message = checkpoint_error(directory)
    assert INDEX_FILE in message and "model-00002-of-00002.safetensors" in message


@pytest.mark.parametrize("index", ["{oops", "{}", '{"weight_map": []}', '{"weight_map": {"a": 5}}'])
def test_invalid_index(demo_variant, index):
    directory = demo_variant()
    (directory / INDEX_FILE).write_text(index)
    assert str(directory / INDEX_FILE) in checkpoint_error(directory)


def test_missing_tensor(demo_checkpoint, demo_variant):
    directory = with_weights(
        demo_checkpoint, demo_variant, lambda weights: weights.pop(EXPERT_TENSOR)
    )
    assert EXPERT_TENSOR in checkpoint_error(directory)


def test_tensor_with_wrong_shape(demo_checkpoint, demo_variant):
    def shrink(weights: dict[str, torch.Tensor]) -> None:
        weights[EXPERT_TENSOR] = weights[EXPERT_TENSOR][:-1].clone()  # [I - 1, H]

    directory = with_weights(demo_checkpoint, demo_variant, shrink)
    message = checkpoint_error(directory)
    assert EXPERT_TENSOR in message and WEIGHTS_FILE in message
    config = json.loads((demo_checkpoint / "config.json").read_text())
    inter, hidden = config["moe_intermediate_size"], config["hidden_size"]
    assert f"({inter - 1}, {hidden})" in message and f"({inter}, {hidden})" in message


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _garbage_header(data: bytes) -> bytes:
    header = b"this is not json"
    return len(header).to_bytes(8, "little") + header + data[8:]


def _header_longer_than_file(data: bytes) -> bytes:
    return (len(data) * 2).to_bytes(8, "little") + data[8:]


@pytest.mark.parametrize(
    "corrupt", [_truncated, _garbage_header, _header_longer_than_file, lambda data: b""]
)
def test_corrupt_weight_file(demo_checkpoint, demo_variant, corrupt):
    directory = demo_variant(skip=(WEIGHTS_FILE,))
    (directory / WEIGHTS_FILE).write_bytes(corrupt((demo_checkpoint / WEIGHTS_FILE).read_bytes()))
    assert str(directory / WEIGHTS_FILE) in checkpoint_error(directory)


# --- config.json fields ---------------------------------------------------------------------

# (changes to the demo's config.json, the field the error must name)
UNSUPPORTED_CONFIGS = {
    "unknown architecture": ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
    "dynamic rope_scaling": (
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        "rope_scaling",
    ),
    "dynamic rope_parameters": (
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        "rope_parameters",
    ),
    "rope_scaling not a dict": ({"rope_scaling": "linear"}, "rope_scaling"),
    "rope factor missing": ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
    "rope_theta not a number": ({"rope_theta": "big"}, "rope_theta"),
    "gelu experts": ({"hidden_act": "gelu"}, "hidden_act"),
    "qwen2 sliding window": (
        {"architectures": ["Qwen2MoeForCausalLM"], "use_sliding_window": True},
        "use_sliding_window",
    ),
    "required field null": ({"hidden_size": None}, "hidden_size"),
    "string for int": ({"hidden_size": "big"}, "hidden_size"),
    "bool for int": ({"num_experts_per_tok": True}, "num_experts_per_tok"),
    "string for float": ({"rms_norm_eps": "tiny"}, "rms_norm_eps"),
    "top-k above experts": ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    "top-k zero": ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    "zero heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "zero layers": ({"num_hidden_layers": 0}, "num_hidden_layers"),
    "zero kv heads": ({"num_key_value_heads": 0}, "num_key_value_heads"),
    "heads not a multiple of kv heads": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "mlp_only_layers not a list": ({"mlp_only_layers": 0}, "mlp_only_layers"),
    "mlp_only_layers of strings": ({"mlp_only_layers": ["0"]}, "mlp_only_layers"),
    "mlp_only_layers of lists": ({"mlp_only_layers": [[0]]}, "mlp_only_layers"),
    "decoder_sparse_step zero": ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    "eos_token_id a string": ({"eos_token_id": "<|im_end|>"}, "eos_token_id"),
    "eos_token_id list with null": ({"eos_token_id": [2, None]}, "eos_token_id"),
}


@pytest.mark.parametrize(
    ("changes", "field"), list(UNSUPPORTED_CONFIGS.values()), ids=list(UNSUPPORTED_CONFIGS)
)
def test_unsupported_config(demo_variant, changes, field):
    directory = demo_variant(changes)
    with pytest.raises(UnsupportedConfigError) as info:
        load_model(directory)
    assert field in str(info.value)


@pytest.mark.parametrize(
    "field",
    ["architectures", "num_experts_per_tok", "num_experts", "hidden_size", "moe_intermediate_size"],
)
def test_required_field_missing(demo_variant, field):
    directory = demo_variant(drop_fields=(field,))
    with pytest.raises(UnsupportedConfigError) as info:
        load_model(directory)
    assert f"'{field}'" in str(info.value)


def test_supported_rope_parameters_load(demo_variant):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    directory = demo_variant({"rope_parameters": rope})
    assert load_model(directory).cfg.rope.factor == 2.0


# --- loading that works ---------------------------------------------------------------------


def write_sharded(demo_checkpoint: Path, demo_variant: Callable[..., Path]) -> Path:
    """The demo with its weights split over two shards named by model.safetensors.index.json."""
    directory = demo_variant(skip=(WEIGHTS_FILE,))
    weights = load_file(str(demo_checkpoint / WEIGHTS_FILE))
    names = sorted(weights)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for file_name, shard in halves.items():
        save_file({n: weights[n] for n in shard}, str(directory / file_name))
        weight_map.update(dict.fromkeys(shard, file_name))
    total_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index))
    return directory


def test_sharded_checkpoint_gives_identical_logits(demo_checkpoint, demo_variant):
    sharded = write_sharded(demo_checkpoint, demo_variant)
    shard_offsets = {}
    for shard in sharded.glob("*.safetensors"):
        shard_offsets.update(tensor_offsets_mod_64(shard))
    # the same weights at other addresses mod 64 (which must not change a bit of the logits)
    assert shard_offsets != tensor_offsets_mod_64(demo_checkpoint / WEIGHTS_FILE)
    single = Engine.from_pretrained(demo_checkpoint)
    ids = single.encode(PROMPT)
    expected = single.model.logits(ids)  # [T, V]
    actual = Engine.from_pretrained(sharded).model.logits(ids)
    max_diff = (actual - expected).abs().max().item()
    assert torch.equal(actual, expected), f"max abs diff {max_diff}"


RSS_SCRIPT = """
import re, sys, torch
from hybridmoe.models.loading import load_model

def rss_anon_bytes():
    status = open("/proc/self/status").read()
    return int(re.search(r"RssAnon:\\s+(\\d+) kB", status).group(1)) * 1024

# numba and the float32 CPU kernels load (or compile) on a first CPU decode-sized call: their
# memory is not the weights', so it is spent before measuring: the serial entry (a small
# weight) and the parallel one (>= 1 MiB), for 3 tokens as logits() below calls them, and a
# router's step (numba_dense.dense_route and its entry)
from hybridmoe.kernels.projection import DenseProjection
DenseProjection(torch.zeros(4, 8))(torch.zeros(1, 3, 8))
DenseProjection(torch.zeros(1024, 1024))(torch.zeros(1, 3, 1024))
DenseProjection(torch.randn(4, 8)).route(torch.randn(3, 8), 2, True, torch.float32)
before = rss_anon_bytes()
model = load_model(sys.argv[1], torch.float32)
model.logits([1, 2, 3])  # reads every layer's weights
after_fp32 = rss_anon_bytes()
cast = load_model(sys.argv[1], torch.bfloat16)
after_bf16 = rss_anon_bytes()
print(after_fp32 - before, after_bf16 - after_fp32)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_same_dtype_load_is_memory_mapped(aligned_demo_checkpoint):
    # A fresh process, so memory freed by earlier tests cannot hide a copy.
    result = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(aligned_demo_checkpoint)],
        capture_output=True,
        text=True,
        check=True,
    )
    fp32_growth, bf16_growth = map(int, result.stdout.split())
    weight_bytes = (aligned_demo_checkpoint / WEIGHTS_FILE).stat().st_size
    assert fp32_growth < 0.5 * weight_bytes, (
        f"fp32 load grew anonymous memory by {fp32_growth} bytes; weights are {weight_bytes}"
    )
    # The measurement can see a copy: casting to bf16 must allocate half the weights.
    assert bf16_growth > 0.25 * weight_bytes, f"bf16 load grew RssAnon by only {bf16_growth}"


def test_bfloat16_load_is_close_to_float32(demo_checkpoint):
    fp32 = Engine.from_pretrained(demo_checkpoint, EngineConfig(dtype="float32"))
    bf16 = Engine.from_pretrained(demo_checkpoint, EngineConfig(dtype="bfloat16"))
    assert bf16.model.dtype == torch.bfloat16 and bf16.model.embed.dtype == torch.bfloat16
    ids = fp32.encode(PROMPT)
    expected, actual = fp32.model.logits(ids), bf16.model.logits(ids)  # [T, V] float32 both
    scale = expected.abs().max().item()
    max_diff = (actual - expected).abs().max().item()
    assert max_diff < 0.1 * scale, f"max abs diff {max_diff} at logit scale {scale}"
    same_argmax = (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert same_argmax >= 0.8, f"argmax agrees at only {same_argmax:.0%} of positions"
