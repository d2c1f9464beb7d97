"""Rotary position embeddings: inverse frequencies per RoPE type, applied rotate-half style."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # layers sit below models: no import of them at run time
    from hybridmoe.config.model import RopeConfig


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    return 1.0 / (theta**exponents)


def _linear(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    return _default_inv_freq(rope.theta, dim) / rope.factor, 1.0


def _llama3(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    inv_freq = _default_inv_freq(rope.theta, dim)
    old_len = rope.original_max_position
    low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    factor, base, old_len = rope.factor, rope.theta, rope.original_max_position
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_share = 1 - ramp  # [dim/2]
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_share) + (
        1.0 / pos_freqs
    ) * extrapolation_share
    return inv_freq, float(attention_factor)


_ROPE_TYPES = {
    "default": lambda rope, dim: (_default_inv_freq(rope.theta, dim), 1.0),
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


TABLE_CHUNK = 1024  # positions a decode table grows by


class RotaryEmbedding:
    def __init__(self, rope: RopeConfig, head_dim: int):
        rotary_dim = int(head_dim * rope.partial_rotary_factor)  # as transformers rounds it
        self.inv_freq, self.attention_factor = _ROPE_TYPES[rope.rope_type](rope, rotary_dim)
        # per dtype: the cos and sin tables [P, R] and their [P, 1, R] views
        self._tables: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}

    def to(self, device: torch.device) -> None:
        self.inv_freq = self.inv_freq.to(device)
        self._tables = {}

    def table_cos_sin(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        length: int,
        starts: tuple[int, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin(positions, dtype) for positions [B, T] below `length`, as rows of tables
        cos_sin computed over whole chunks of TABLE_CHUNK positions, grown on demand: a
        decode step's 2 ops instead of cos_sin's 8 (~20 -> 5 µs, 270 -> 110 µs with the
        caches cold). The same bits: every op of cos_sin is elementwise, and its cos and sin
        give each position's values whatever the length they are computed over
        (tests/layers/test_rotary_table.py checks every position of the tables). `starts`:
        the positions as ints where the caller has them (a decode step's rows, T = 1): one row's
        are then a slice of the tables, a view (~5 µs where the indexing took ~20 on a decode
        step's cold caches)."""
        table = self._tables.get(dtype)
        have = 0 if table is None else table[0].shape[0]
        if length > have:
            end = -(-length // TABLE_CHUNK) * TABLE_CHUNK
            more = torch.arange(have, end, device=self.inv_freq.device)[None]  # [1, P]
            cos, sin = (t[0] for t in self.cos_sin(more, dtype))  # [P, R] each
            if table is not None:
                cos, sin = torch.cat((table[0], cos)), torch.cat((table[1], sin))
            table = self._tables[dtype] = (cos, sin, cos[:, None], sin[:, None])
        if starts is not None and len(starts) == 1 and positions.shape == (1, 1):
            at = slice(starts[0], starts[0] + 1)  # of the tables' [P, 1, R] views
            return table[2][at], table[3][at]
        return table[0][positions], table[1][positions]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [B, T] int -> cos, sin [B, T, R] in dtype (R: the rotary dims)."""
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D]; cos/sin [B, T, R], R <= D: the first R dims rotate, the rest pass."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def signed_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary_signed's tables from cos/sin [B, T, D] (every dim rotating): cos
    [B, T, 1, D] and sin with its first half negated [B, T, 1, D]."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(2), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)


def apply_rotary_signed(
    x: torch.Tensor, cos4: torch.Tensor, signed_sin4: torch.Tensor
) -> torch.Tensor:
    """apply_rotary's bits where every dim rotates, in 4 ops instead of ~10: x [B, T, heads, D]
    with signed_tables' cos4, signed_sin4. The halves swapped times the signed sin is
    cat(-x2, x1) * sin to the bit: negation is exact and commutes with a rounded product."""
    return x * cos4 + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin4
