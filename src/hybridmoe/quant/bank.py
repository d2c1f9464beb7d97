"""ExpertBank: one MoE layer's routed experts stacked [E, ...] in one weight format, wherever they
live (host memory, or the accelerator: its cache slots and prefill buffers are banks too, in
the same format as the host banks they copy from); and ExpertWeights, the checkpoint's
per-expert matrices before they are stacked.

A bank is the single home of a layer's expert weights: it is filled from the checkpoint one
layer at a time and the mapped file pages are then released, so no second full copy stays
resident. A bank in a quantised format holds GGUF blocks: each row of n weights is n / 32
blocks of bytes, so `gate_up` is uint8 [E, 2I, row_bytes(H)].
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridmoe.loader.weights import WeightSource, aligned
from hybridmoe.quant.formats import WeightFormat, dense_format


@dataclass
class ExpertWeights:
    """One MoE layer's routed experts, each matrix a view into the checkpoint: the `resident`
    target on the cpu device computes from them in place; every other target stacks them into
    a ExpertBank."""

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
        shape: tuple[int, int, int],
        names: tuple[str, str, str],
    ) -> ExpertWeights:
        """`prefix`.{e}.{name}.weight for e < E; shape = (E, H, I)."""
        num_experts, hidden, inter = shape
        shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
        # Unaligned views: most targets copy them into a bank (aligned) anyway, and one that
        # computes from them in place aligns them first (align()).
        per_projection = [
            [
                source.get(f"{prefix}.{e}.{name}.weight", shape, align=False)
                for e in range(num_experts)
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

    def expert_mlp(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        """h [n, H] -> down(silu(gate h) * up h) [n, H] in h's dtype (the weights' dtype)."""
        act = F.silu(F.linear(h, self.gate[expert])) * F.linear(h, self.up[expert])
        return F.linear(act, self.down[expert])


@dataclass(eq=False)
class ExpertBank:
    gate_up: torch.Tensor  # [E, 2I, H] in `fmt` (gate rows, then up rows)
    down: torch.Tensor  # [E, H, I] in `fmt`
    fmt: WeightFormat = field(default=None)  # None: the dense format of gate_up's dtype
    _byte_views: tuple | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.fmt is None:
            self.fmt = dense_format(self.gate_up.dtype)

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.down.shape[1]  # down's rows are never packed

    @property
    def intermediate_size(self) -> int:
        return self.gate_up.shape[1] // 2

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert occupies (what fetching it copies)."""
        return self.gate_up[0].nbytes + self.down[0].nbytes

    def compute_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        """The dtype the experts' projections are computed in for activations of `act_dtype`:
        `act_dtype` when the bank stores exactly that dtype, else float32, in which every
        stored format (quantised blocks, f32, bf16) expands exactly. Either way each
        projection's output is then rounded to `act_dtype` (the accumulation contract)."""
        if not self.fmt.is_quantized and self.fmt.storage_dtype == act_dtype:
            return act_dtype
        return torch.float32

    def expert_mlp(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        """h [n, H] -> down(silu(gate h) * up h) [n, H] in h's dtype, gate and up in one GEMM;
        each projection from the exact weights, its output rounded to h's dtype."""
        if not self.fmt.is_quantized and self.gate_up.dtype == h.dtype:  # no casts to make
            gate, up = F.linear(h, self.gate_up[expert]).chunk(2, dim=-1)  # 2 x [n, I]
            return F.linear(F.silu(gate) * up, self.down[expert])
        dtype = self.compute_dtype(h.dtype)  # float32: every stored value expands exactly
        gate_up = F.linear(h.to(dtype), self.gate_up_weights(expert, dtype)).to(h.dtype)
        gate, up = gate_up.chunk(2, dim=-1)  # 2 x [n, I]
        act = (F.silu(gate) * up).to(dtype)
        return F.linear(act, self.down_weights(expert, dtype)).to(h.dtype)

    def gate_up_weights(self, expert: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s gate_up [2I, H] as `dtype` (a view when already so stored); for
        a tensor of n expert indices (on the bank's device), their gate_up [n, 2I, H]."""
        return _as_float(self.fmt, self.gate_up[expert], dtype)

    def down_weights(self, expert: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s down [H, I] as `dtype` (a view when already so stored); for a
        tensor of n expert indices, their down [n, H, I]."""
        return _as_float(self.fmt, self.down[expert], dtype)

    def byte_views(self) -> tuple:
        """(gate_up, down) as flat uint8 numpy arrays over the same memory (host banks only)."""
        if self._byte_views is None:
            self._byte_views = tuple(
                t.view(torch.uint8).reshape(-1).numpy() for t in (self.gate_up, self.down)
            )
        return self._byte_views

    def converted(self, fmt: WeightFormat) -> ExpertBank:
        """A new bank holding these experts in `fmt`, converted one expert at a time (peak
        extra memory: one expert in float32). ValueError if H or I is not a whole number of
        fmt's blocks."""
        fmt.check_row_length(self.hidden_size, "hidden_size (gate/up rows)")
        fmt.check_row_length(self.intermediate_size, "moe_intermediate_size (down rows)")
        num, hidden, inter, device = (
            self.num_experts,
            self.hidden_size,
            self.intermediate_size,
            self.gate_up.device,
        )
        gate_up = self.empty_like_tensor(fmt, (num, 2 * inter, hidden), device)
        down = self.empty_like_tensor(fmt, (num, hidden, inter), device)
        for expert in range(num):
            gate_up[expert] = fmt.quantize(self.gate_up_weights(expert, torch.float32))
            down[expert] = fmt.quantize(self.down_weights(expert, torch.float32))
        return ExpertBank(gate_up, down, fmt)

    def empty_slots(self, num_slots: int, device: torch.device | str) -> ExpertBank:
        """A zero-filled bank of `num_slots` experts in this bank's format, on `device`."""
        shape_gu = (num_slots, *self.gate_up.shape[1:])
        shape_dn = (num_slots, *self.down.shape[1:])
        dtype = self.gate_up.dtype
        gate_up = torch.zeros(shape_gu, dtype=dtype, device=device)
        down = torch.zeros(shape_dn, dtype=dtype, device=device)
        return ExpertBank(gate_up, down, self.fmt)

    def expert_copies(
        self, expert: int, slots: ExpertBank, slot: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source, destination) pairs that copy expert `expert`'s stored bytes into slot `slot`
        of `slots` (same format), for Platform.start_copies."""
        return [(self.gate_up[expert], slots.gate_up[slot]), (self.down[expert], slots.down[slot])]

    def in_own_pages(self) -> ExpertBank:
        """This bank copied into memory pages no other allocation shares (each tensor starts a
        page and its size is rounded up to whole pages): page-locking registers whole pages,
        and a second registration that touches an already locked page is refused."""
        return ExpertBank(_in_own_pages(self.gate_up), _in_own_pages(self.down), self.fmt)

    def to(self, device: torch.device | str) -> ExpertBank:
        """This bank on `device` (itself when already there)."""
        if self.gate_up.device == torch.device(device):
            return self
        return ExpertBank(self.gate_up.to(device), self.down.to(device), self.fmt)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    @staticmethod
    def empty_like_tensor(fmt: WeightFormat, shape: Sequence[int], device) -> torch.Tensor:
        """Uninitialised storage for a float weight of `shape` [..., n] in `fmt`."""
        return torch.empty(fmt.stored_shape(tuple(shape)), dtype=fmt.storage_dtype, device=device)

    @classmethod
    def stack(cls, experts: ExpertWeights) -> ExpertBank:
        """A bank holding a copy of the experts' gate/up [I, H] and down [H, I] matrices, in
        their dtype."""
        pairs = zip(experts.gate, experts.up, strict=True)
        gate_up = torch.stack([torch.cat(pair) for pair in pairs])
        return cls(gate_up, torch.stack(experts.down))

    def views(self) -> ExpertWeights:
        """Per-expert views of this (dense) bank's matrices."""
        inter = self.intermediate_size
        return ExpertWeights(
            list(self.gate_up[:, :inter]), list(self.gate_up[:, inter:]), list(self.down)
        )


def _in_own_pages(tensor: torch.Tensor) -> torch.Tensor:
    page = mmap.PAGESIZE
    nbytes = tensor.numel() * tensor.element_size()
    raw = torch.empty(-(-nbytes // page) * page + page, dtype=torch.uint8)  # [whole pages + 1]
    start = -raw.data_ptr() % page
    owned = raw[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
    owned.copy_(tensor)
    return owned


def _as_float(fmt: WeightFormat, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not fmt.is_quantized and stored.dtype == dtype:
        return stored
    return fmt.dequantize(stored, dtype)
