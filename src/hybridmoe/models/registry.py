"""MODEL_REGISTRY: model families by the `architectures` name of their config.json.

A family is one module (models/<family>.py) that registers a `ModelFamily` naming its parts:
the config parser and its reference defaults, the weight names, and the kinds of router,
shared expert and attention it is built from (each a registry of its own, below models), and
the model builder. Importing `hybridmoe.models` imports every family module, so the registry is
full before anything reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridmoe.config.model import ConfigDefaults, HfConfigReader, ModelConfig
from hybridmoe.errors import UnsupportedConfigError
from hybridmoe.layers.attention import ATTENTIONS
from hybridmoe.layers.moe import SHARED_EXPERTS, ExpertsLoader
from hybridmoe.layers.norm import NORMS
from hybridmoe.loader.weights import WeightSource
from hybridmoe.models.gguf_config import GgufSpec
from hybridmoe.moe.routing import ROUTERS

if TYPE_CHECKING:
    from hybridmoe.models.transformer import MoeCausalLM

# (cfg, family, source) -> the model, every tensor it needs read from `source`
ModelBuilder = Callable[[ModelConfig, "ModelFamily", WeightSource], "MoeCausalLM"]


@dataclass(frozen=True)
class WeightNames:
    """Where a family's MoE weights live in a decoder layer's checkpoint names."""

    moe_prefix: str = "mlp"  # model.layers.{i}.<moe_prefix>.gate / .experts.{e}
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    model_prefix: str = "model"  # <model_prefix>.embed_tokens / .layers.{i} / .norm
    # Checkpoint tensors under these prefixes are not the text model's and are not read (a
    # vision tower, multi-token-prediction heads); loading says so in one line.
    ignored_prefixes: tuple[str, ...] = ()
    router: str = "gate"  # model.layers.{i}.<moe_prefix>.<router>.weight
    # reads the experts of a family that stores them otherwise than one tensor per expert and
    # projection (then expert_names are unused)
    experts_loader: ExpertsLoader | None = None


@dataclass(frozen=True)
class ModelFamily:
    architecture: str  # config.json `architectures` name
    parse_config: Callable[[HfConfigReader], ModelConfig]
    defaults: ConfigDefaults  # the reference default of every field parse_config `get`s
    build: ModelBuilder
    weights: WeightNames = field(default_factory=WeightNames)
    router: str = "softmax_topk"  # a kind in moe.routing.ROUTERS
    shared_expert: str | None = None  # a kind in layers.moe.SHARED_EXPERTS, or none
    attention: str = "gqa"  # a kind in layers.attention.ATTENTIONS
    # The kind of the layers ModelConfig.linear_layers marks linear (prefix `linear_attn`)
    linear_attention: str | None = None
    norm: str = "rms"  # a kind in layers.norm.NORMS
    gguf: GgufSpec | None = None  # how the family is stored in GGUF files, if it can be
    # `quantization_config.quant_method`s whose checkpoints the family reads as stored
    quant_methods: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for role, kind, kinds in (
            ("router", self.router, ROUTERS),
            ("shared expert", self.shared_expert, SHARED_EXPERTS),
            ("attention", self.attention, ATTENTIONS),
            ("linear attention", self.linear_attention, ATTENTIONS),
            ("norm", self.norm, NORMS),
        ):
            if kind is not None and kind not in kinds:
                raise ValueError(
                    f"{self.architecture}: unknown {role} kind {kind!r}; "
                    f"registered: {', '.join(sorted(kinds))}"
                )

    def config_from(self, raw_config: dict, source: str = "config.json") -> ModelConfig:
        return self.parse_config(HfConfigReader(raw_config, source, self.defaults))


MODEL_REGISTRY: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    if family.architecture in MODEL_REGISTRY:
        raise ValueError(f"model family {family.architecture!r} is already registered")
    MODEL_REGISTRY[family.architecture] = family
    return family


def family_for_gguf(architecture: str, source: str) -> ModelFamily:
    """The family whose GGUF `general.architecture` is `architecture`."""
    for family in MODEL_REGISTRY.values():
        if family.gguf is not None and family.gguf.architecture == architecture:
            return family
    supported = sorted(f.gguf.architecture for f in MODEL_REGISTRY.values() if f.gguf)
    raise UnsupportedConfigError(
        f"{source}: metadata key 'general.architecture' = {architecture!r} names no supported "
        f"model (supported: {', '.join(supported)})"
    )


def family_for(raw_config: dict, source: str = "config.json") -> ModelFamily:
    architectures = raw_config.get("architectures") or []
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise UnsupportedConfigError(
        f"{source}: field 'architectures' = {architectures!r} names no supported model "
        f"(supported: {', '.join(sorted(MODEL_REGISTRY))})"
    )
