"""Decode fast paths of attention's q/k/v, each beside its reference: q, k and v projected
by one CPU kernel call (StackedQKV), the per-head q/k norms with rotary done on q and k as
one tensor (norm_rotary_qk; its reference norm_rotary_qk_reference), rotary in 4 ops
(rotate; its reference rotary.apply_rotary). Each gives its reference's bits
(tests/layers/test_norm_rotary_qk.py, tests/layers/test_stacked_qkv.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridmoe.kernels.projection import DenseProjection, stack_rows, stackable
from hybridmoe.layers.batch import ForwardBatch
from hybridmoe.layers.norm import rms_norm
from hybridmoe.layers.rotary import apply_rotary, apply_rotary_signed


def norm_rotary_qk_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    batch: ForwardBatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm then rotary, of q [B, T, heads, D] and k [B, T, kv_heads, D] one
    after the other: the reference of norm_rotary_qk."""
    q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return apply_rotary(q, batch.cos, batch.sin), apply_rotary(k, batch.cos, batch.sin)


def norm_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    qk_weight: torch.Tensor,
    eps: float,
    batch: ForwardBatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_rotary_qk_reference's bits for a bf16/fp16 q and k in half the ops: q and k side
    by side as one [B, T, heads + kv_heads, D] tensor, normalised and rotated at once (every
    step is per row or elementwise). qk_weight [heads + kv_heads, D]: each head's norm weight
    (joint_qk_weight). Returns views into that tensor."""
    heads = q.shape[2]
    qk = torch.cat((q, k), dim=2)  # [B, T, heads + kv_heads, D]
    normed = F.rms_norm(qk.float(), (qk.shape[-1],), None, eps).to(qk.dtype)
    qk = rotate(qk_weight * normed, batch)
    return qk[:, :, :heads], qk[:, :, heads:]


def rotate(x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """apply_rotary(x, batch.cos, batch.sin), by apply_rotary_signed where every dim rotates
    (the same bits; tests/layers/test_norm_rotary_qk.py)."""
    if batch.cos.shape[-1] != x.shape[-1]:
        return apply_rotary(x, batch.cos, batch.sin)
    return apply_rotary_signed(x, *batch.rotary_tables())


def joint_qk_weight(q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int, kv_heads: int):
    """[heads + kv_heads, D]: the q norm's weight [D] for each query head, then k's for each
    key head (norm_rotary_qk's qk_weight)."""
    return torch.cat((q_weight.expand(heads, -1), k_weight.expand(kv_heads, -1)))


@dataclass(eq=False)
class StackedQKV:
    """q, k and v's projections as one (kernels/projection.stack_rows: the parts' weights
    become views of its rows), for the CPU kernel: one call instead of three. Where v cannot
    stack with q and k (another format: a Q4_K_M file's v in Q6_K beside Q4_K q and k),
    `stacked` is q and k's and `v` v's own projection: two calls."""

    stacked: DenseProjection
    weights: tuple[torch.Tensor, ...]  # the parts' weights when stacked (holds() checks them)
    sizes: tuple[int, ...]  # each part's out_features
    v: DenseProjection | None = None

    @classmethod
    def of(cls, parts: tuple[DenseProjection, ...]) -> StackedQKV | None:
        """The parts stacked, all three or q and k (v apart); None where q and k cannot stack
        (projection.stackable)."""
        q, k, v = parts
        apart = not stackable(parts)
        if apart and not stackable((q, k)):
            return None
        stacked = stack_rows((q, k) if apart else parts)  # the parts' weights become its views
        weights, sizes = tuple(p.weight for p in parts), tuple(p.out_features for p in parts)
        return cls(stacked, weights, sizes, v if apart else None)

    def holds(self, parts: tuple[DenseProjection, ...]) -> bool:
        """Whether `parts` still compute from this stack (quantize() or to() replace a part's
        weight, set_activation_quant its arithmetic: then it must be stacked again)."""
        (q, k, v), w = parts, self.weights  # asked by every layer's decode step: no generator
        same = q.weight is w[0] and k.weight is w[1] and v.weight is w[2]
        return same and q.activation_quant == self.stacked.activation_quant

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., H] -> each part's [..., out] (views of one output), for an x the parts'
        uses_kernel accepts (attention checks it before calling): the kernel at once."""
        if self.v is not None:
            q, k = self.stacked.kernel(x).split(self.sizes[:2], dim=-1)
            return q, k, self.v.kernel(x)
        return self.stacked.kernel(x).split(self.sizes, dim=-1)

    def heads(self, x: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, ...]:
        """As calling it, each part viewed per head, [..., out / head_dim, head_dim]: one view
        and one split of the output (2 aten ops, not a split and a view per part)."""
        y = self.stacked.kernel(x)
        counts = [size // head_dim for size in self.sizes]
        if self.v is not None:
            q, k = y.view(*y.shape[:-1], sum(counts[:2]), head_dim).split(counts[:2], dim=-2)
            v = self.v.kernel(x)
            return q, k, v.view(*v.shape[:-1], counts[2], head_dim)
        return y.view(*y.shape[:-1], sum(counts), head_dim).split(counts, dim=-2)
