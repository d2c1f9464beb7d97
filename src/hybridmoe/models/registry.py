"""MODEL_REGISTRY: model families by the `architectures` name of their config.json."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridmoe.errors import UnsupportedConfigError
from hybridmoe.models.config import ConfigDefaults, HfConfigReader, ModelConfig


@dataclass(frozen=True)
class ModelFamily:
    architecture: str
    parse_config: Callable[[HfConfigReader], ModelConfig]
    defaults: ConfigDefaults  # the reference default of every field parse_config `get`s
    moe_prefix: str = "mlp"  # where a decoder layer's MoE block lives
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def config_from(self, raw_config: dict, source: str = "config.json") -> ModelConfig:
        return self.parse_config(HfConfigReader(raw_config, source, self.defaults))


MODEL_REGISTRY: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    MODEL_REGISTRY[family.architecture] = family
    return family


def family_for(raw_config: dict, source: str = "config.json") -> ModelFamily:
    import hybridmoe.models.families  # noqa: F401  (registers every family)

    architectures = raw_config.get("architectures") or []
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise UnsupportedConfigError(
        f"{source}: field 'architectures' = {architectures!r} names no supported model "
        f"(supported: {', '.join(sorted(MODEL_REGISTRY))})"
    )
