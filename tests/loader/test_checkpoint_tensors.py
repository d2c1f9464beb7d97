"""Every tensor of a checkpoint is used by the model its config.json describes, or loading fails
naming the unused ones; the output head is chosen as `transformers` chooses it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_checkpoints import write_hf_checkpoint
from hybridmoe.errors import CheckpointError
from hybridmoe.models.loading import load_model

WEIGHTS_FILE = "model.safetensors"


def rewrite(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """`directory` with its model.safetensors replaced by the same weights after `edit`."""
    weights = load_file(str(directory / WEIGHTS_FILE))
    edit(weights)
    (directory / WEIGHTS_FILE).unlink()  # a demo_variant's file is a link to the demo's
    save_file(weights, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def edit_config(directory: Path, **changes) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return directory


def checkpoint_error(directory: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(directory)
    assert info.type is CheckpointError, f"expected a plain CheckpointError, got {info.value!r}"
    return str(info.value)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint("qwen2_moe", "shared_expert", tmp_path_factory.mktemp("qwen2"))


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    directory = tmp_path / "copy"
    directory.mkdir()
    for path in checkpoint.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    return directory


def test_layers_beyond_num_hidden_layers_are_refused(demo_variant):
    message = checkpoint_error(demo_variant({"num_hidden_layers": 3}))  # the demo has 6
    assert "model.layers.3." in message and "does not use" in message
    assert "more" in message  # the first few are named, the rest counted


def test_shared_expert_tensors_without_a_shared_expert_are_refused(qwen2_moe, tmp_path):
    directory = edit_config(copy_of(qwen2_moe, tmp_path), shared_expert_intermediate_size=0)
    message = checkpoint_error(directory)
    assert "model.layers.0.mlp.shared_expert" in message


def test_shared_expert_width_defaults_to_the_reference(qwen2_moe, tmp_path):
    # Without the field Qwen2-MoE's width is 5632 (Qwen2MoeConfig), not "no shared expert":
    # this checkpoint's width-48 shared experts then disagree in shape, by name.
    directory = copy_of(qwen2_moe, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    del config["shared_expert_intermediate_size"]
    (directory / "config.json").write_text(json.dumps(config))
    message = checkpoint_error(directory)
    assert "shared_expert" in message and "5632" in message


def test_an_extra_tensor_is_named(demo_variant):
    extra = "model.layers.0.mlp.bonus.weight"
    directory = rewrite(demo_variant(), lambda w: w.update({extra: torch.zeros(4)}))
    message = checkpoint_error(directory)
    assert extra in message and "1 of the checkpoint's tensors" in message


def test_rotary_inv_freq_buffers_are_ignored(demo_variant):
    # Old exporters saved them per layer; they are derived from config.json (transformers
    # skips them too).
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    directory = rewrite(demo_variant(), lambda w: w.update({name: torch.ones(32)}))
    assert load_model(directory).cfg.num_layers == 6


# --- the output head (the demo is tied and stores no lm_head.weight) ------------------------


def test_tied_head_stored_equal_is_the_embedding(demo_variant):
    def add_head(weights):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()

    model = load_model(rewrite(demo_variant(), add_head))
    assert model.lm_head.weight is model.embed


def test_tied_head_stored_different_is_used(demo_variant):
    # transformers 5 unties then ("both are present in the checkpoints with different values,
    # so we will NOT tie them") and uses the stored head.
    head = torch.randn(4096, 192)
    model = load_model(rewrite(demo_variant(), lambda w: w.update({"lm_head.weight": head})))
    assert torch.equal(model.lm_head.weight, head) and model.lm_head.weight is not model.embed


def test_untied_config_without_a_head_is_refused(demo_variant):
    # No silent tying: transformers would leave such a head randomly initialised.
    message = checkpoint_error(demo_variant({"tie_word_embeddings": False}))
    assert "lm_head.weight" in message and "missing" in message
