"""The family registry: each family is a typed entry naming its parts (parser, weight names,
router, shared-expert and attention kinds, builder); kinds that are not registered are refused
when the entry is made; a family made of existing parts is one registration; importing any
module of hybridmoe.models registers every family, and layers/ does not import models."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from hybridmoe.layers.attention import ATTENTIONS
from hybridmoe.layers.moe import SHARED_EXPERTS
from hybridmoe.models import registry
from hybridmoe.models.gpt_oss import load_gpt_oss_experts
from hybridmoe.models.loading import load_model
from hybridmoe.models.qwen3_moe import QWEN3_MOE
from hybridmoe.models.registry import MODEL_REGISTRY, ModelFamily, WeightNames, register
from hybridmoe.models.transformer import MoeCausalLM
from hybridmoe.moe.routing import ROUTERS

QWEN_WEIGHTS = WeightNames("mlp", ("gate_proj", "up_proj", "down_proj"))
MIXTRAL_WEIGHTS = WeightNames("block_sparse_moe", ("w1", "w3", "w2"))
HYBRID_WEIGHTS = WeightNames(ignored_prefixes=("mtp.",))
VL_IGNORED = ("mtp.", "model.visual.")
# architecture -> (weight names, router kind, shared-expert kind, attention kind, linear
# attention kind, norm kind)
PARTS = {
    "Qwen3MoeForCausalLM": (QWEN_WEIGHTS, "softmax_topk", None, "gqa", None, "rms"),
    "Qwen2MoeForCausalLM": (QWEN_WEIGHTS, "softmax_topk", "sigmoid_gated", "gqa", None, "rms"),
    "MixtralForCausalLM": (MIXTRAL_WEIGHTS, "softmax_topk", None, "gqa", None, "rms"),
    "OlmoeForCausalLM": (QWEN_WEIGHTS, "softmax_topk", None, "gqa", None, "rms"),
    "Qwen3NextForCausalLM": (
        HYBRID_WEIGHTS, "softmax_topk", "sigmoid_gated", "gated_gqa", "gated_deltanet_qkvz",
        "offset_rms",
    ),
    "Qwen3_5MoeForCausalLM": (
        WeightNames(ignored_prefixes=VL_IGNORED), "softmax_topk", "sigmoid_gated", "gated_gqa",
        "gated_deltanet", "offset_rms",
    ),
    "Qwen3_5MoeForConditionalGeneration": (
        WeightNames(model_prefix="model.language_model", ignored_prefixes=VL_IGNORED),
        "softmax_topk", "sigmoid_gated", "gated_gqa", "gated_deltanet", "offset_rms",
    ),
    "GptOssForCausalLM": (
        WeightNames(router="router", experts_loader=load_gpt_oss_experts), "topk_softmax", None,
        "gqa_sinks", None, "rms",
    ),
}  # fmt: skip


@pytest.mark.parametrize("architecture", PARTS)
def test_family_names_its_parts(architecture):
    family = MODEL_REGISTRY[architecture]
    parts = (family.weights, family.router, family.shared_expert, family.attention)
    parts += (family.linear_attention, family.norm)
    assert parts == PARTS[architecture]
    assert family.build is MoeCausalLM
    assert family.router in ROUTERS and family.attention in ATTENTIONS
    assert family.shared_expert is None or family.shared_expert in SHARED_EXPERTS


def test_every_registered_family_is_listed():
    assert set(MODEL_REGISTRY) == set(PARTS)


@pytest.mark.parametrize(
    ("role", "change"),
    [
        ("router", {"router": "sigmoid_group_topk"}),
        ("shared expert", {"shared_expert": "ungated"}),
        ("attention", {"attention": "linear_hybrid"}),
        ("linear attention", {"linear_attention": "mamba2"}),
        ("norm", {"norm": "layer_norm"}),
    ],
)
def test_unknown_kind_is_refused_when_the_family_is_made(role, change):
    with pytest.raises(ValueError) as info:
        replace(QWEN3_MOE, architecture="NewMoeForCausalLM", **change)
    message = str(info.value)
    kind = next(iter(change.values()))
    assert f"unknown {role} kind {kind!r}" in message and "NewMoeForCausalLM" in message


def test_an_architecture_is_registered_once():
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        register(QWEN3_MOE)


def test_a_family_of_existing_parts_is_one_registration(monkeypatch, demo_variant):
    # What a new family's module does, here for a twin of Qwen3-MoE under another name: it
    # loads the demo checkpoint and computes exactly what the demo computes.
    monkeypatch.setattr(registry, "MODEL_REGISTRY", dict(MODEL_REGISTRY))
    twin = register(
        ModelFamily(
            architecture="TwinMoeForCausalLM",
            parse_config=QWEN3_MOE.parse_config,
            defaults=QWEN3_MOE.defaults,
            build=MoeCausalLM,
            router="softmax_topk",
            attention="gqa",
        )
    )
    assert registry.family_for({"architectures": ["TwinMoeForCausalLM"]}) is twin
    ids = [5, 17, 300, 42, 8, 99]
    expected = load_model(demo_variant()).logits(ids)  # [T, V]
    actual = load_model(demo_variant({"architectures": ["TwinMoeForCausalLM"]})).logits(ids)
    assert torch.equal(actual, expected), f"max abs diff {(actual - expected).abs().max()}"


IMPORTS_SCRIPT = """
import sys
import hybridmoe.layers.attention, hybridmoe.layers.moe, hybridmoe.layers.rotary
import hybridmoe.loader.checkpoint
assert not [m for m in sys.modules if m.startswith("hybridmoe.models")], "layers import models"
from hybridmoe.models.registry import MODEL_REGISTRY
print(" ".join(sorted(MODEL_REGISTRY)))
"""


def test_importing_the_registry_registers_every_family_and_layers_do_not_import_models():
    # A fresh process: in this one every module is imported already.
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_SCRIPT], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == sorted(PARTS)
