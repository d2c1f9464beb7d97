"""Mixture-of-Experts layer: softmax top-k router, routed SwiGLU experts, optional shared expert.

`moe_reference` is the plain expert math, kept forever as the oracle every fast path is
checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridmoe.kernels.torch_moe import gathered_moe
from hybridmoe.layers.linear import GatedMLP, Linear
from hybridmoe.loader.weights import WeightSource, aligned, release_pages
from hybridmoe.models.config import ModelConfig
from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import FUSED_MAX_TOKENS, bank_moe
from hybridmoe.moe.host_banks import HostExpertBank
from hybridmoe.moe.hybrid_decode import HybridDecodeExecutor, HybridDecodeRequest
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.moe.prefill import ExpertPrefill
from hybridmoe.moe.routing import combine_experts, route
from hybridmoe.quant.formats import WeightFormat, dense_format

GATHER_MAX_TOKENS = FUSED_MAX_TOKENS  # decode batches up to this size gather on an accelerator


@dataclass
class ExpertWeights:
    """One MoE layer's routed experts, each a view into the checkpoint."""

    gate: list[torch.Tensor]  # E x [I, H]
    up: list[torch.Tensor]  # E x [I, H]
    down: list[torch.Tensor]  # E x [H, I]

    @property
    def num_experts(self) -> int:
        return len(self.gate)

    @classmethod
    def load(
        cls,
        source: WeightSource,
        prefix: str,
        cfg: ModelConfig,
        names: tuple[str, str, str],
    ) -> ExpertWeights:
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
        # Unaligned views: most targets copy them into a bank (aligned) anyway, and one that
        # computes from them in place aligns them first (align()).
        per_projection = [
            [
                source.get(f"{prefix}.{e}.{name}.weight", shape, align=False)
                for e in range(cfg.num_experts)
            ]
            for name, shape in zip(names, shapes, strict=True)
        ]
        return cls(*per_projection)

    def align(self) -> None:
        """Make every matrix 64-byte aligned (loader.weights.aligned: a CPU kernel's result may
        depend on its weight's address), copying the few that are not."""
        self.gate, self.up, self.down = (
            [aligned(w) for w in ws] for ws in (self.gate, self.up, self.down)
        )


def moe_reference(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertWeights
) -> torch.Tensor:
    """Σ_k w[t,k] · down_e(silu(gate_e x_t) ⊙ up_e x_t) with e = topk_ids[t,k]; ids < 0 skipped.

    x [T, H], topk_ids [T, K], topk_weights [T, K] -> the float32 partial [T, H]: each
    expert's MLP in x's dtype (as `transformers` computes it), the weighted sum in float32.
    """
    return combine_experts(
        x, topk_ids, topk_weights, lambda h, expert: _expert_mlp(h, experts, expert)
    )


def _expert_mlp(h: torch.Tensor, experts: ExpertWeights, expert: int) -> torch.Tensor:
    """h [n, H] -> down(silu(gate h) * up h) [n, H] for one expert."""
    h = F.silu(F.linear(h, experts.gate[expert])) * F.linear(h, experts.up[expert])
    return F.linear(h, experts.down[expert])


class OffloadMoELayer:
    """Router + routed experts (+ a sigmoid-gated shared expert where the family has one).

    Prefill computes the routed experts exactly with `moe_reference` (with `bank_moe` when
    the experts were converted to another weight format at load). Decode runs them where
    `decode_target` says (see OffloadConfig); the layer owns only the expert math
    (`_expert_gemm`), never placement or scheduling.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        source: WeightSource,
        prefix: str,
        names: tuple[str, ...],
        moe_idx: int,
    ):
        self.cfg, self.moe_idx = cfg, moe_idx
        self.router = Linear.load(source, f"{prefix}.gate", cfg.hidden_size, cfg.num_experts, False)
        self.experts = ExpertWeights.load(source, f"{prefix}.experts", cfg, names)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP.load(
                source,
                f"{prefix}.shared_expert",
                cfg.hidden_size,
                cfg.shared_expert_intermediate_size,
            )
            self.shared_expert_gate = Linear.load(
                source, f"{prefix}.shared_expert_gate", cfg.hidden_size, 1, bias=False
            )
        self.decode_target = "gpu"  # every expert resident; without a bank: moe_reference
        self.bank: HostExpertBank | None = None
        self.cache: OffloadMoeCache | None = None
        self.cpu_executor: CpuMoeExecutor | None = None
        self.hybrid_executor: HybridDecodeExecutor | None = None
        self.prefill: ExpertPrefill | None = None  # prefill experts when not resident

    def to(self, device: torch.device) -> None:
        """Moves the router and the shared expert; the routed experts are the runtime's."""
        self.router.to(device)
        if self.shared_expert is not None:
            self.shared_expert.to(device)
            self.shared_expert_gate.to(device)

    def dense_tensors(self) -> list[torch.Tensor]:
        """The weights to() moves."""
        found = self.router.dense_tensors()
        if self.shared_expert is not None:
            found += self.shared_expert.dense_tensors() + self.shared_expert_gate.dense_tensors()
        return found

    def adopt_bank(
        self, fmt: WeightFormat | None = None, drop_experts: bool = False
    ) -> HostExpertBank:
        """Move this layer's experts into a stacked host bank in `fmt` (None: their dtype).
        A bank in their own dtype re-points the ExpertWeights at views of it, unless
        `drop_experts`; a converted bank replaces them (`experts` becomes None and every path
        computes from the bank)."""
        old = self.experts
        bank = HostExpertBank.stack(old.gate, old.up, old.down)
        release_pages(old.gate + old.up + old.down)  # the bank is now their only copy
        if fmt is not None and fmt != bank.fmt:
            bank = bank.converted(fmt)
        if drop_experts or bank.fmt != dense_format(old.gate[0].dtype):
            self.bank, self.experts = bank, None
            return bank
        inter = bank.intermediate_size
        self.experts.gate = list(bank.gate_up[:, :inter])
        self.experts.up = list(bank.gate_up[:, inter:])
        self.experts.down = list(bank.down)
        self.bank = bank
        return bank

    def attach(
        self,
        decode_target: str,
        cache: OffloadMoeCache | None = None,
        cpu_executor: CpuMoeExecutor | None = None,
        hybrid_executor: HybridDecodeExecutor | None = None,
        prefill: ExpertPrefill | None = None,
    ) -> None:
        self.decode_target, self.cache, self.cpu_executor = decode_target, cache, cpu_executor
        self.hybrid_executor, self.prefill = hybrid_executor, prefill

    def detach(self) -> None:
        """Drop the runtime's parts and the bank (device memory for `gpu` on an accelerator);
        a layer whose experts lived only in its bank cannot run afterwards."""
        self.attach(self.decode_target)
        self.bank = None

    def __call__(self, x: torch.Tensor, is_decode: bool = False) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]. Every expert path returns its float32 partial; the routed
        output is rounded to x's dtype here, once (the accumulation contract)."""
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        cfg = self.cfg
        topk_ids, topk_weights = route(
            self.router(flat), cfg.top_k, cfg.norm_topk_prob, cfg.router_weights_fp32
        )
        if is_decode:
            partial = self._decode_experts(flat, topk_ids, topk_weights)
        elif self.prefill is not None:
            partial = self.prefill(self.moe_idx, flat, topk_ids, topk_weights)
        elif self.experts is None:  # the experts live only in a converted bank
            partial = bank_moe(flat, topk_ids, topk_weights, self.bank)
        else:
            partial = moe_reference(flat, topk_ids, topk_weights, self.experts)
        out = partial.to(x.dtype)  # [N, H]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)

    def _decode_experts(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H], topk_ids [T, K] (rewritten in place by the cache), topk_weights [T, K]
        -> the float32 partial [T, H]."""
        target = self.decode_target
        if target == "gpu" and self.bank is not None:
            return self._expert_gemm(x, topk_ids, topk_weights, self.bank)
        if target == "offload":
            return self._decode_offload(x, topk_ids, topk_weights)
        if target == "cpu":
            self.cpu_executor.decode_submit(self.moe_idx, x, topk_ids, topk_weights)
            return self.cpu_executor.decode_sync(self.moe_idx)
        if target == "hybrid":
            request = HybridDecodeRequest(self.moe_idx, x, topk_ids, topk_weights)
            return self.hybrid_executor.decode(request, self._run_cached_decode_experts)
        return moe_reference(x, topk_ids, topk_weights, self.experts)

    def _decode_offload(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Every miss fetched. A batched step routing to more distinct experts than the cache
        holds runs token by token (exact: tokens are independent in the MoE)."""
        may_overflow = x.shape[0] > 1 and topk_ids.numel() > self.cache.num_slots  # no sync
        if may_overflow and torch.unique(topk_ids).numel() > self.cache.num_slots:
            rows = [slice(t, t + 1) for t in range(x.shape[0])]
            return torch.cat(
                [self._decode_offload(x[r], topk_ids[r], topk_weights[r]) for r in rows]
            )
        self.cache.ensure_experts(self.moe_idx, topk_ids)
        self.cache.copy_missing()
        return self._run_cached_decode_experts(x, topk_ids, topk_weights)

    def _run_cached_decode_experts(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The accelerator side: routes [T, K] given as cache slots, computed on the slot views."""
        return self._expert_gemm(x, slots, weights, self.cache.slot_bank)

    def _expert_gemm(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, bank: HostExpertBank
    ) -> torch.Tensor:
        """Expert math on stacked weights of any format, on the bank's device; the accelerator's
        expert kernel. On an accelerator, decode's few routes take `gathered_moe` (no host
        sync, the same kernels whatever the routing); otherwise the grouped reference."""
        if x.device.type != "cpu" and x.shape[0] <= GATHER_MAX_TOKENS:
            return gathered_moe(x, ids, weights, bank)
        return bank_moe(x, ids, weights, bank)
