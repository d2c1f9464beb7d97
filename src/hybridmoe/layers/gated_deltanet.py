"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5 (attention kinds
"gated_deltanet_qkvz" and "gated_deltanet": the two checkpoint layouts of one layer).

x -> in_proj -> (q k v | z | b | a); q k v -> causal depthwise conv1d (its last inputs are
the conv state) -> silu; q, k l2-normalised, q scaled by key_head_dim^-0.5; decay
g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); the gated delta rule over the
matrix state (layers/delta_rule.py); gated RMSNorm with silu(z); out_proj.

A prefill step (not `batch.is_decode`) starts every row from a zero state, as a fresh
sequence from position 0 does; a decode step continues each row's state. Either writes the
state after its tokens back into `batch.kv`'s rows (engine/kv_cache.KVCache holds it): a
decode step of one token per row updates them in place (delta_rule.delta_rule_step, the conv
window shifted by one), anything else gathers the rows and writes the final states back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hybridmoe.layers.attention import register_attention
from hybridmoe.layers.batch import ForwardBatch
from hybridmoe.layers.delta_rule import (
    chunked_delta_rule,
    delta_rule_step,
    l2_normalize,
    recurrent_delta_rule,
)
from hybridmoe.layers.linear import Linear
from hybridmoe.layers.norm import gated_rms_norm
from hybridmoe.loader.weights import WeightSource

if TYPE_CHECKING:  # layers sit below models: no import of them at run time
    from hybridmoe.config.model import LinearAttentionConfig, ModelConfig


class GatedDeltaNet:
    """One Gated DeltaNet layer; `in_proj` [conv_dim + value_dim + 2 value_heads, H] holds the
    q, k, v (all heads, head-major), z, b and a projections in that order."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, weights: dict[str, torch.Tensor]):
        self.spec: LinearAttentionConfig = cfg.linear_attention
        self.layer_idx, self.eps = layer_idx, cfg.rms_norm_eps
        self.in_proj = Linear(weights["in_proj"])
        self.conv_weight = weights["conv"]  # [conv_dim, 1, kernel]
        self.dt_bias, self.A_log = weights["dt_bias"], weights["A_log"]  # [value_heads] each
        self.norm = weights["norm"]  # [value_head_dim]
        self.out_proj = Linear(weights["out_proj"])  # [H, value_dim]

    @staticmethod
    def common_weights(cfg: ModelConfig, source: WeightSource, prefix: str) -> dict:
        s = cfg.linear_attention
        return {
            "conv": source.get(f"{prefix}.conv1d.weight", (s.conv_dim, 1, s.conv_kernel)),
            "dt_bias": source.get(f"{prefix}.dt_bias", (s.num_value_heads,)),
            "A_log": source.get(f"{prefix}.A_log", (s.num_value_heads,)),
            "norm": source.get(f"{prefix}.norm.weight", (s.value_head_dim,)),
            "out_proj": source.get(f"{prefix}.out_proj.weight", (cfg.hidden_size, s.value_dim)),
        }

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]."""
        s = self.spec
        B, T, _ = x.shape
        mixed, z, b, a = self.in_proj(x).split(
            [s.conv_dim, s.value_dim, s.num_value_heads, s.num_value_heads], dim=-1
        )
        beta = b.sigmoid()  # [B, T, value_heads]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if batch.is_decode and batch.kv is not None and T == 1:
            out = self._decode_step(mixed[:, 0], g[:, 0], beta[:, 0], batch)[:, None]
        else:
            out = self._sequence(mixed, g, beta, batch).transpose(1, 2)
        out = out.to(x.dtype)  # [B, T, value_heads, value_head_dim]
        gate = z.view(B, T, s.num_value_heads, s.value_head_dim)
        return self.out_proj(gated_rms_norm(out, self.norm, gate, self.eps).reshape(B, T, -1))

    def _sequence(self, mixed, g, beta, batch: ForwardBatch) -> torch.Tensor:
        """Any number of tokens per row (a prefill from zeros, or a decode without the fast
        path): mixed [B, T, conv_dim], g, beta [B, T, value_heads] -> o [B, value_heads, T,
        value_head_dim] float32; the state after is written into batch.kv's rows."""
        s = self.spec
        conv_rows, delta_rows = self._rows_state(batch)  # None: start from zeros
        mixed, conv_after = self._conv(mixed, conv_rows)  # [B, T, conv_dim]
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        out, delta_after = self._delta_rule(q, k, v, g, beta, delta_rows, batch.is_decode)
        if batch.kv is not None:
            conv_all, delta_all = batch.kv.recurrent_state(self.layer_idx)
            conv_all[batch.row_index] = conv_after
            delta_all[batch.row_index] = delta_after
        return out

    def _decode_step(self, mixed, g, beta, batch: ForwardBatch) -> torch.Tensor:
        """One token per row, the rows' states updated in place: mixed [B, conv_dim], g, beta
        [B, value_heads] -> o [B, value_heads, value_head_dim] float32."""
        s = self.spec
        B = mixed.shape[0]
        conv_all, delta_all = batch.kv.recurrent_state(self.layer_idx)
        mixed = self._conv_step(mixed, conv_all, batch.row_index)
        q, k, v = mixed.float().split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = l2_normalize(q.view(B, s.num_key_heads, s.key_head_dim)) / s.key_head_dim**0.5
        k = l2_normalize(k.view(B, s.num_key_heads, s.key_head_dim))
        v = v.view(B, s.num_value_heads, s.value_head_dim)
        return delta_rule_step(q, k, v, g, beta.float(), delta_all, batch.row_index)

    def _conv_step(self, x: torch.Tensor, conv_all: torch.Tensor, rows: torch.Tensor):
        """_conv for one token per row: x [B, C] -> silu(conv) [B, C]; conv_all[rows]
        [B, C, kernel - 1] shifted by one input in place. The same conv1d over the window as
        _conv (and transformers' decode step), so the same rounding."""
        window = torch.cat((conv_all[rows], x[..., None].to(conv_all.dtype)), dim=-1)
        conv_all[rows] = window[..., 1:]  # window [B, C, kernel]
        out = F.conv1d(window.to(x.dtype), self.conv_weight, groups=x.shape[1])  # [B, C, 1]
        return F.silu(out[..., 0])

    def _rows_state(self, batch: ForwardBatch) -> tuple[torch.Tensor | None, ...]:
        if not batch.is_decode or batch.kv is None:
            return None, None
        conv_all, delta_all = batch.kv.recurrent_state(self.layer_idx)
        return conv_all[batch.row_index], delta_all[batch.row_index]

    def _conv(self, mixed: torch.Tensor, past: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """mixed [B, T, C], past [B, C, kernel - 1] or None (zeros) -> (silu(conv) [B, T, C],
        the last kernel - 1 inputs [B, C, kernel - 1])."""
        x = mixed.transpose(1, 2)  # [B, C, T]
        width = self.spec.conv_kernel - 1
        if past is None:
            past = x.new_zeros(x.shape[0], x.shape[1], width)
        window = torch.cat((past.to(x.dtype), x), dim=-1)  # [B, C, width + T]
        out = F.conv1d(window, self.conv_weight, groups=x.shape[1])  # [B, C, T]
        return F.silu(out).transpose(1, 2), window[..., -width:].contiguous()

    def _delta_rule(self, q, k, v, g, beta, state, is_decode):
        """q, k [B, T, key_dim], v [B, T, value_dim], g, beta [B, T, value_heads] -> (o
        [B, value_heads, T, value_head_dim] float32, the state after)."""
        s = self.spec
        B, T, _ = q.shape
        group = s.num_value_heads // s.num_key_heads  # value heads per key head

        def heads(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
            return t.reshape(B, T, n, dim).transpose(1, 2).float()  # [B, n, T, dim]

        q = heads(q, s.num_key_heads, s.key_head_dim).repeat_interleave(group, dim=1)
        k = heads(k, s.num_key_heads, s.key_head_dim).repeat_interleave(group, dim=1)
        v = heads(v, s.num_value_heads, s.value_head_dim)
        g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()  # [B, heads, T]
        q, k = l2_normalize(q), l2_normalize(k)
        if is_decode:  # transformers' two torch forms scale q differently; each as its own
            return recurrent_delta_rule(q / s.key_head_dim**0.5, k, v, g, beta, state)
        return chunked_delta_rule(q * s.key_head_dim**-0.5, k, v, g, beta, state)

    def to(self, device: torch.device) -> None:
        for name in ("conv_weight", "dt_bias", "A_log", "norm"):
            setattr(self, name, getattr(self, name).to(device))
        self.in_proj.to(device)
        self.out_proj.to(device)

    def dense_tensors(self) -> list[torch.Tensor]:
        """The weights to() moves."""
        found = [self.conv_weight, self.dt_bias, self.A_log, self.norm]
        return found + self.in_proj.dense_tensors() + self.out_proj.dense_tensors()

    def projections(self) -> list[Linear]:
        """The projections --dense-format quantises."""
        return [self.in_proj, self.out_proj]


@register_attention("gated_deltanet")
def load_gated_deltanet(
    cfg: ModelConfig, layer_idx: int, source: WeightSource, prefix: str
) -> GatedDeltaNet:
    """Qwen3.5's layout: in_proj_qkv (q, k, v of all heads), in_proj_z, in_proj_b, in_proj_a."""
    s, hidden = cfg.linear_attention, cfg.hidden_size
    parts = [
        source.get(f"{prefix}.in_proj_qkv.weight", (s.conv_dim, hidden)),
        source.get(f"{prefix}.in_proj_z.weight", (s.value_dim, hidden)),
        source.get(f"{prefix}.in_proj_b.weight", (s.num_value_heads, hidden)),
        source.get(f"{prefix}.in_proj_a.weight", (s.num_value_heads, hidden)),
    ]
    weights = GatedDeltaNet.common_weights(cfg, source, prefix)
    return GatedDeltaNet(cfg, layer_idx, {**weights, "in_proj": torch.cat(parts)})


@register_attention("gated_deltanet_qkvz")
def load_gated_deltanet_qkvz(
    cfg: ModelConfig, layer_idx: int, source: WeightSource, prefix: str
) -> GatedDeltaNet:
    """Qwen3-Next's layout: in_proj_qkvz and in_proj_ba, each grouped by key head (per key
    head: its q, its k, then the v and z of its value heads; its b's, then its a's). The rows
    are reordered into in_proj's (q, k, v, z, b, a) once, at load."""
    s, hidden = cfg.linear_attention, cfg.hidden_size
    group = s.num_value_heads // s.num_key_heads
    dk, dv_group = s.key_head_dim, group * s.value_head_dim
    qkvz = source.get(f"{prefix}.in_proj_qkvz.weight", (2 * s.key_dim + 2 * s.value_dim, hidden))
    ba = source.get(f"{prefix}.in_proj_ba.weight", (2 * s.num_value_heads, hidden))
    qkvz = qkvz.view(s.num_key_heads, 2 * dk + 2 * dv_group, hidden)
    ba = ba.view(s.num_key_heads, 2 * group, hidden)
    q, k, v, z = qkvz.split([dk, dk, dv_group, dv_group], dim=1)
    b, a = ba.split([group, group], dim=1)
    parts = [t.reshape(-1, hidden) for t in (q, k, v, z, b, a)]  # each head-major
    weights = GatedDeltaNet.common_weights(cfg, source, prefix)
    return GatedDeltaNet(cfg, layer_idx, {**weights, "in_proj": torch.cat(parts)})
