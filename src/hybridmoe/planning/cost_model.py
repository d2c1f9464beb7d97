"""The decode cost model: seconds per decoded token of a model shape on a hardware profile, for
each decode target, from how a cache's calls split into hits, fetches and CPU experts.

One decode step (batch 1) = the dense weights read once + per MoE layer call the target's
expert work + per-layer orchestration (HardwareProfile.layer_overhead_s). Per call, with h
distinct resident experts, f fetched and c computed on the CPU:
  resident / offload: (h + f) accelerator experts + f fetches (offload: c = 0)
  cpu: c CPU experts + one CPU job
  hybrid: accelerator side (h + f experts, f fetches) and CPU side (c experts + a job),
          overlapped (max) on an accelerator; summed on the cpu device (one set of cores).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.config.model import ModelConfig
from hybridmoe.loader.gguf import GgufFile, is_gguf
from hybridmoe.models.loading import gguf_family_config
from hybridmoe.models.registry import family_for
from hybridmoe.moe.fetch_policy import FetchCosts
from hybridmoe.planning.hardware import HardwareProfile
from hybridmoe.quant.formats import WEIGHT_FORMATS, weight_format

BOTTLENECKS = ("CPU DRAM", "PCIe", "GPU", "orchestration")


def _stored_expert_format(gguf: GgufFile) -> str | None:
    """The registered format every `blk.N.ffn_*_exps` tensor of `gguf` is stored in, if one."""
    types = {t.type_name for name, t in gguf.tensors.items() if name.endswith("_exps.weight")}
    name = types.pop().lower() if len(types) == 1 else None
    return name if name in WEIGHT_FORMATS else None


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model, read from its config.json or a GGUF file's metadata
    only (no weights)."""

    name: str
    hidden: int
    moe_inter: int
    num_layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    dense_params: int  # weights read once per decoded token outside the routed experts
    # the weight format a GGUF file stores every routed expert in (None: a float checkpoint,
    # or a file mixing types, as Q4_K_M does)
    stored_format: str | None = None

    @classmethod
    def from_config(cls, path: str | Path) -> ModelShape:
        """From a checkpoint directory or its config.json, or a GGUF model (a .gguf file, the
        first part of a split set, a directory of one); the family's own parser validates."""
        path = Path(path)
        if is_gguf(path):
            gguf = GgufFile(path)
            _, cfg = gguf_family_config(gguf)
            return cls.of(cfg, gguf.path.stem, _stored_expert_format(gguf))
        file = path / "config.json" if path.is_dir() else path
        raw = json.loads(file.read_text())
        cfg = family_for(raw, str(file)).config_from(raw, str(file))
        return cls.of(cfg, path.name if path.is_dir() else file.stem)

    @classmethod
    def of(cls, cfg: ModelConfig, name: str, stored_format: str | None = None) -> ModelShape:
        h, layers = cfg.hidden_size, cfg.num_layers
        attention = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
        moe = sum(cfg.sparse_layers)
        dense_mlp = (layers - moe) * 3 * h * cfg.intermediate_size
        shared = moe * (3 * h * cfg.shared_expert_intermediate_size + h)
        routers = moe * cfg.num_experts * h
        dense = layers * attention + dense_mlp + shared + routers + cfg.vocab_size * h
        return cls(
            name, h, cfg.moe_intermediate_size, layers, moe, cfg.num_experts, cfg.top_k, dense,
            stored_format,
        )  # fmt: skip

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.num_experts

    def expert_nbytes(self, fmt_name: str) -> int:
        fmt = weight_format(fmt_name)
        return 2 * self.moe_inter * fmt.row_bytes(self.hidden) + self.hidden * fmt.row_bytes(
            self.moe_inter
        )


@dataclass(frozen=True)
class CallMix:
    """A cache's calls as weighted (h, f, c) counts of distinct experts; weights sum to 1."""

    calls: tuple[tuple[float, int, int, int], ...]  # (share, hits, fetched, cpu)


@dataclass(frozen=True)
class StepCost:
    seconds: float  # per decoded token
    parts_s: dict[str, float]  # BOTTLENECKS -> seconds per token

    @property
    def tok_per_s(self) -> float:
        return 1.0 / self.seconds

    @property
    def bottleneck(self) -> str:
        return max(self.parts_s, key=self.parts_s.get)


@dataclass(frozen=True)
class CostModel:
    shape: ModelShape
    hw: HardwareProfile
    expert_format: str  # the routed experts' format (f32, bf16, q8_0, ...)
    dense_dtype: str = "float32"  # the dense weights' dtype (float32, bfloat16)

    @property
    def dense_bytes_per_param(self) -> int:
        return 4 if self.dense_dtype == "float32" else 2

    def fetch_costs(self) -> FetchCosts:
        """The per-expert costs of one decode call, as `--max-fetch auto` balances them."""
        nbytes = self.shape.expert_nbytes(self.expert_format)
        fmt = self.expert_format
        return FetchCosts(
            fetch_s=nbytes / (self.hw.h2d_gbps * 1e9),
            accel_expert_s=self.hw.accel_expert[fmt].seconds(nbytes),
            cpu_expert_s=self.hw.cpu_expert[fmt].seconds(nbytes),
            cpu_job_s=self.hw.cpu_job_s,
        )

    @property
    def overlapped(self) -> bool:
        return self.hw.device != "cpu"

    def step(self, target: str, mix: CallMix) -> StepCost:
        """Predicted seconds per decoded token of `target` whose calls split as `mix`."""
        c = self.fetch_costs()
        parts = dict.fromkeys(BOTTLENECKS, 0.0)
        for share, h, f, cpu in mix.calls:
            accel = {"GPU": (h + f) * c.accel_expert_s, "PCIe": f * c.fetch_s}
            on_cpu = {"CPU DRAM": cpu * c.cpu_expert_s + (c.cpu_job_s if cpu else 0.0)}
            sides = (accel, on_cpu) if cpu else (accel,)
            if self.overlapped and len(sides) == 2:  # only the longer side costs time
                sides = (max(sides, key=lambda side: sum(side.values())),)
            for side in sides:
                for name, seconds in side.items():
                    parts[name] += share * seconds * self.shape.moe_layers
        parts["GPU"] += (
            self.shape.dense_params
            * self.dense_bytes_per_param
            / (self.hw.dense_gbps[self.dense_dtype] * 1e9)
        )
        overhead = self.hw.layer_overhead_s
        parts["orchestration"] = self.shape.moe_layers * overhead.get(target, 0.0) + (
            self.shape.num_layers * overhead.get("per_layer", 0.0)
        )
        return StepCost(sum(parts.values()), parts)
