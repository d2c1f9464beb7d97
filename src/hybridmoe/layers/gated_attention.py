"""Gated full attention of Qwen3-Next and Qwen3.5 (attention kind "gated_gqa"): q_proj
gives each head's query and an output gate side by side; zero-centred RMSNorms (scale
1 + w) on q and k per head; rotary on part of each head (RopeConfig.partial_rotary_factor);
the attention output is multiplied by sigmoid(gate) before o_proj."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridmoe.layers.attention import attend, register_attention
from hybridmoe.layers.batch import ForwardBatch
from hybridmoe.layers.linear import Linear
from hybridmoe.layers.norm import offset_rms_norm, offset_weight
from hybridmoe.loader.weights import WeightSource

if TYPE_CHECKING:  # layers sit below models: no import of them at run time
    from hybridmoe.config.model import ModelConfig


@register_attention("gated_gqa")
class GatedAttention:
    def __init__(self, cfg: ModelConfig, layer_idx: int, source: WeightSource, prefix: str):
        self.cfg, self.layer_idx = cfg, layer_idx
        hidden, bias = cfg.hidden_size, cfg.qkv_bias
        # [heads * 2D, H]: per head, its query rows then its gate rows
        self.q_proj = Linear.load(source, f"{prefix}.q_proj", hidden, 2 * cfg.q_size, bias)
        self.k_proj = Linear.load(source, f"{prefix}.k_proj", hidden, cfg.kv_size, bias)
        self.v_proj = Linear.load(source, f"{prefix}.v_proj", hidden, cfg.kv_size, bias)
        self.o_proj = Linear.load(source, f"{prefix}.o_proj", cfg.q_size, hidden, cfg.o_bias)
        self.q_scale = offset_weight(source.get(f"{prefix}.q_norm.weight", (cfg.head_dim,)))
        self.k_scale = offset_weight(source.get(f"{prefix}.k_norm.weight", (cfg.head_dim,)))

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]."""
        cfg = self.cfg
        B, T, _ = x.shape
        q_gate = self.q_proj(x).view(B, T, cfg.num_heads, 2 * cfg.head_dim)
        q, gate = q_gate.chunk(2, dim=-1)  # [B, T, heads, D] each
        q = offset_rms_norm(q, self.q_scale, cfg.rms_norm_eps)
        k = self.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        k = offset_rms_norm(k, self.k_scale, cfg.rms_norm_eps)
        v = self.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        out = attend(q, k, v, batch, self.layer_idx).reshape(B, T, cfg.q_size)
        return self.o_proj(out * torch.sigmoid(gate.reshape(B, T, cfg.q_size)))

    def to(self, device: torch.device) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            linear.to(device)
        self.q_scale, self.k_scale = self.q_scale.to(device), self.k_scale.to(device)

    def dense_tensors(self) -> list[torch.Tensor]:
        """The weights to() moves."""
        found = [self.q_scale, self.k_scale]
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            found += linear.dense_tensors()
        return found

    def projections(self) -> list[Linear]:
        """The projections --dense-format quantises."""
        return [self.q_proj, self.k_proj, self.v_proj, self.o_proj]
