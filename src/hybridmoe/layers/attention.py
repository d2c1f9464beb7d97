"""Attention kinds (a registry): grouped-query attention with rotary embeddings, optional
q/k norms and qkv clipping, as ModelConfig says."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from hybridmoe.kernels import attention_block, glue
from hybridmoe.layers.batch import ForwardBatch
from hybridmoe.layers.linear import Linear
from hybridmoe.layers.norm import rms_norm
from hybridmoe.layers.qkv import (
    StackedQKV,
    joint_qk_weight,
    norm_rotary_qk,
    norm_rotary_qk_reference,
    rotate,
)
from hybridmoe.loader.weights import WeightSource
from hybridmoe.registry import registering

if TYPE_CHECKING:  # layers sit below models: no import of them at run time
    from hybridmoe.config.model import ModelConfig


class AttentionLayer(Protocol):
    """x [B, T, H] -> [B, T, H] for one decoder layer; reads and writes `batch.kv` (when not
    None) at this layer's index."""

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor: ...

    def to(self, device: torch.device) -> None: ...

    def dense_tensors(self) -> list[torch.Tensor]: ...

    def projections(self) -> list[Linear]:
        """The projections --dense-format quantises."""
        ...


# kind -> factory(cfg, layer index, source, the layer's attention prefix) -> AttentionLayer
ATTENTIONS: dict[str, Callable[[ModelConfig, int, WeightSource, str], AttentionLayer]] = {}


def register_attention(kind: str) -> Callable:
    """Decorator: register an AttentionLayer factory under `kind`."""
    return registering(ATTENTIONS, "attention kind", kind)


def create_attention(
    kind: str, cfg: ModelConfig, layer_idx: int, source: WeightSource, prefix: str
) -> AttentionLayer:
    if kind not in ATTENTIONS:
        raise ValueError(
            f"unknown attention kind {kind!r}; registered: {', '.join(sorted(ATTENTIONS))}"
        )
    return ATTENTIONS[kind](cfg, layer_idx, source, prefix)


# (q [B, heads, T, D], k/v [B, kv_heads, S, D], mask or None, is_causal) -> [B, heads, T, D]
AttendFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor
]


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool
) -> torch.Tensor:
    """The AttendFn of plain attention: torch's SDPA, grouped-query when heads differ."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    layer_idx: int,
    window: int | None = None,
    attend_fn: AttendFn = sdpa,
    rotated: bool = False,
) -> torch.Tensor:
    """Rotary on q [B, T, heads, D] and k [B, T, kv_heads, D] (unless `rotated`: done
    already), then `attend_fn` over this step's keys and values (v [B, T, kv_heads, D]) and
    those `batch.kv` holds for layer `layer_idx`, within `window` positions (None: all)
    -> [B, T, heads, D]. Where `attend_fn` is sdpa itself (plain softmax attention), the
    store's fused_attention may compute it instead (the CPU decode kernel, kernels/
    numba_attention.py: within its tolerance of sdpa)."""
    if not rotated:  # one numba call on the host at decode sizes, else rotate's 4 ops each
        fast = glue.norm_rotary(q, k, None, None, 0.0, batch.cos, batch.sin)
        q, k = fast if fast is not None else (rotate(q, batch), rotate(k, batch))
    if batch.kv is not None and attend_fn is sdpa:
        out = batch.kv.fused_attention(layer_idx, batch, q, k, v, window)
        if out is not None:
            return out
    if batch.kv is None:
        k_all, v_all = k.transpose(1, 2), v.transpose(1, 2)  # [B, kv_heads, T, D]
    else:
        k_all, v_all = batch.kv.update(layer_idx, batch, k, v)
    mask, is_causal = batch.mask(window)
    out = attend_fn(q.transpose(1, 2), k_all, v_all, mask, is_causal)  # [B, heads, T, D]
    return out.transpose(1, 2)


@register_attention("gqa")
class GroupedQueryAttention:
    """Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE: q/k/v/o projections (biases, q/k norms per head
    or over all heads, qkv clipping as ModelConfig says), rotary, SDPA over the KV cache."""

    # this kind's AttendFn: sdpa itself, so attend() may hand a decode step to the store's
    # kernel; SinkAttention overrides it (the kernel has no sink column)
    _attend = staticmethod(sdpa)

    def __init__(self, cfg: ModelConfig, layer_idx: int, source: WeightSource, prefix: str):
        self.cfg, self.layer_idx = cfg, layer_idx
        self.window = cfg.layer_window(layer_idx)  # None: full attention
        hidden, bias = cfg.hidden_size, cfg.qkv_bias
        self.q_proj = Linear.load(source, f"{prefix}.q_proj", hidden, cfg.q_size, bias)
        self.k_proj = Linear.load(source, f"{prefix}.k_proj", hidden, cfg.kv_size, bias)
        self.v_proj = Linear.load(source, f"{prefix}.v_proj", hidden, cfg.kv_size, bias)
        self.o_proj = Linear.load(source, f"{prefix}.o_proj", cfg.q_size, hidden, cfg.o_bias)
        norm_sizes = {"none": None, "per_head": (cfg.head_dim,) * 2}
        norm_sizes["full"] = (cfg.q_size, cfg.kv_size)
        sizes = norm_sizes[cfg.qk_norm]
        self.q_norm = source.get(f"{prefix}.q_norm.weight", sizes[:1]) if sizes else None
        self.k_norm = source.get(f"{prefix}.k_norm.weight", sizes[1:]) if sizes else None
        self._qk_norm = None  # joint_qk_weight, made on first use (after to())
        self._qkv: StackedQKV | None = None  # the CPU kernel's q/k/v in one, made on first use
        self._block_plans: dict = {}  # attention_block.decode_block's, per step shape

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]."""
        cfg = self.cfg
        B, T, _ = x.shape
        if self._blockable():
            out = self._decode_block(x, batch)  # one kernel call on the host, else None
            if out is not None:
                return out
        q, k, v = self._project_heads(x)  # [B, T, heads, D] each
        rotated = cfg.qk_norm == "per_head"
        if rotated:
            q, k = self._norm_rotary(q, k, batch)
        out = attend(q, k, v, batch, self.layer_idx, self.window, self._attend, rotated)
        return self.o_proj(out.reshape(B, T, cfg.q_size))  # out [B, T, heads, D]

    def _decode_block(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        residual: tuple | None = None,
        route: tuple | None = None,
        experts: tuple | None = None,
    ) -> torch.Tensor | tuple | None:
        """The whole call in one numba kernel (kernels/attention_block.py) where the parts
        below would each run theirs: a host decode step with the KV cache's kernel; the same
        bits. None otherwise. With `residual` (delta, input norm, post-attention norm) x is
        the residual stream and the block also runs the layer's two RMSNorms and residual
        adds around the attention, and the router's step after them with `route`, and the
        routed experts' with `experts` (decode_residual_block)."""
        if not self.q_proj.uses_kernel(x) or batch.kv is None or not batch.is_decode:
            return None
        stacked = self._stacked_qkv()
        if stacked is None:  # q and k in different formats: the parts' path
            return None
        cfg = self.cfg
        shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        return attention_block.decode_block(
            stacked.stacked, self.o_proj, self.q_norm, self.k_norm, cfg.rms_norm_eps, x, batch,
            self.layer_idx, self.window, shape, residual, route, experts, self._block_plans,
            stacked.v,
        )  # fmt: skip

    def decode_residual_block(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        batch: ForwardBatch,
        route: tuple | None = None,
        experts: tuple | None = None,
    ) -> tuple | None:
        """(s + attention(rms_norm(s)), rms_norm(that) with post_norm, routes, partial) for s = x +
        delta (a decoder layer's input norm, this attention and its post-attention norm, with
        their residual adds, as layers/norm.add_rms_norm and this call compute them) in one
        numba call on a host decode step; None where the block does not take the step.
        With `route` = (gate, k, renormalise, weights dtype) of the layer's softmax router
        (SoftmaxTopKRouter.block_route), routes are its (ids, weights) of the normed output,
        or the gate's logits where torch must route them (a tie), computed in the same call
        (None where the block leaves the step to the router: kernels/attention_block.
        decode_block). With `experts` (the MoE layer's block_experts) the partial is the
        routed experts' float32 output of those routes, computed in the same call too (None
        where the block did not compute it)."""
        if not self._blockable():
            return None
        return self._decode_block(x, batch, (delta, input_norm, post_norm), route, experts)

    def _blockable(self) -> bool:
        """Whether this layer's attention is one the block computes: plain softmax attention
        (sdpa's, no sink column), per-head q/k norms, no qkv clipping."""
        cfg = self.cfg
        return self._attend is sdpa and cfg.qk_norm == "per_head" and cfg.clip_qkv is None

    def _norm_rotary(
        self, q: torch.Tensor, k: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k norms and rotary: on the host one numba call (kernels/glue.norm_rotary;
        a prefill's on numba's threads), else norm_rotary_qk where its bits are the reference's (a
        half-precision q, every dim rotating), else the reference; all give its bits."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        fast = glue.norm_rotary(q, k, self.q_norm, self.k_norm, eps, batch.cos, batch.sin)
        if fast is not None:
            return fast
        joint = q.dtype in (torch.bfloat16, torch.float16) and batch.cos.shape[-1] == q.shape[-1]
        if not joint:
            return norm_rotary_qk_reference(q, k, self.q_norm, self.k_norm, eps, batch)
        if self._qk_norm is None:
            self._qk_norm = joint_qk_weight(
                self.q_norm, self.k_norm, cfg.num_heads, cfg.num_kv_heads
            )
        return norm_rotary_qk(q, k, self._qk_norm, eps, batch)

    def to(self, device: torch.device) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            linear.to(device)
        self.q_norm = None if self.q_norm is None else self.q_norm.to(device)
        self.k_norm = None if self.k_norm is None else self.k_norm.to(device)
        self._qk_norm = self._qkv = None
        self._block_plans.clear()

    def dense_tensors(self) -> list[torch.Tensor]:
        """The weights to() moves."""
        found = [t for t in (self.q_norm, self.k_norm) if t is not None]
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            found += linear.dense_tensors()
        return found

    def projections(self) -> list[Linear]:
        return [self.q_proj, self.k_proj, self.v_proj, self.o_proj]

    def _project_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> q [B, T, heads, D], k and v [B, T, kv_heads, D]."""
        cfg = self.cfg
        B, T, _ = x.shape
        if cfg.qk_norm != "full" and cfg.clip_qkv is None and self.q_proj.uses_kernel(x):
            stacked = self._stacked_qkv()
            if stacked is not None:
                return stacked.heads(x, cfg.head_dim)  # views of the one kernel call
        q, k, v = self._project(x)  # [B, T, heads * D] each
        q = q.view(B, T, cfg.num_heads, cfg.head_dim)
        k = k.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v.view(B, T, cfg.num_kv_heads, cfg.head_dim)

    def _stacked_qkv(self) -> StackedQKV | None:
        """q, k and v as one projection, or q and k as one and v apart (StackedQKV.of: made on
        first use, again when a part changed); None where q and k cannot stack, and the parts
        then run one by one."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        if self._qkv is None or not self._qkv.holds(parts):
            self._qkv = StackedQKV.of(parts)
        return self._qkv

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        stacked = self._stacked_qkv() if self.q_proj.uses_kernel(x) else None
        if stacked is not None:  # one kernel call for the three: the same bits
            q, k, v = stacked(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if cfg.qk_norm == "full":
            q = rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            clip = cfg.clip_qkv
            q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
        return q, k, v


SINK_SCORES_BYTES = 256 * 2**20  # SinkAttention's scores per chunk of query rows


def _rows(mask: torch.Tensor | None, first: int, count: int) -> torch.Tensor | None:
    """Query rows first .. first + count of a mask [..., T, S] (None stays None)."""
    return None if mask is None else mask[..., first : first + count, :]


@register_attention("gqa_sinks")
class SinkAttention(GroupedQueryAttention):
    """gpt-oss: grouped-query attention whose softmax has one more logit per head, a learned
    `sinks` [heads] column that takes probability mass and is dropped after (as
    `transformers`' eager_attention_forward for GptOss computes it: max-subtracted softmax in
    the scores' dtype over [scores, sink]). Computed eagerly: SDPA has no such column."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, source: WeightSource, prefix: str):
        super().__init__(cfg, layer_idx, source, prefix)
        self.sinks = source.get(f"{prefix}.sinks", (cfg.num_heads,))

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
    ) -> torch.Tensor:
        """q [B, heads, T, D], k/v [B, kv_heads, S, D] -> [B, heads, T, D], in chunks of
        query rows whose float32 scores fit SINK_SCORES_BYTES (a long prefill's [T, S] scores
        per head would not)."""
        B, heads, T, _ = q.shape
        S = k.shape[2]
        if is_causal:  # the step is one sequence from position 0: T == S
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
        groups = heads // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        rows = max(1, SINK_SCORES_BYTES // (4 * B * heads * S))
        chunks = [
            self._attend_rows(q[:, :, i : i + rows], k, v, _rows(mask, i, rows))
            for i in range(0, T, rows)
        ]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)

    def _attend_rows(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [B, heads, t, D], k/v [B, heads, S, D], mask broadcasting to [B, heads, t, S]."""
        B, heads, t, D = q.shape
        scores = torch.matmul(q, k.transpose(2, 3)) * D**-0.5  # [B, heads, t, S]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        sinks = self.sinks.reshape(1, heads, 1, 1).expand(B, heads, t, 1).to(scores.dtype)
        logits = torch.cat([scores, sinks], dim=-1)  # [B, heads, t, S + 1]
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink dropped
        return torch.matmul(probs.to(v.dtype), v)

    def to(self, device: torch.device) -> None:
        super().to(device)
        self.sinks = self.sinks.to(device)

    def dense_tensors(self) -> list[torch.Tensor]:
        return super().dense_tensors() + [self.sinks]
