"""ExpertBank: one MoE layer's routed experts [E, ...] in one weight format, wherever they live
(host memory, a memory-mapped file, or the accelerator: its cache slots and prefill buffers
are banks too, in the same format and layout as the host banks they copy from).

A bank is the single home of a layer's expert weights: stacked from a checkpoint one layer at
a time (the mapped file pages then released), or a file's merged expert tensors themselves,
so no second full copy stays resident. A bank in a quantised format holds GGUF blocks: each
row of n weights is n / 32 blocks of bytes, so gate is uint8 [E, I, row_bytes(H)].
ExpertWeights (quant/expert_weights.py) is re-exported here; stacking writes each matrix into
its rows through quant/stacking.py.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hybridmoe.loader.huge_pages import advise_huge_pages
from hybridmoe.quant import activation_q8
from hybridmoe.quant.expert_math import (
    SILU,
    ExpertActivation,
    ExpertBiases,
    activate,
    add_down_bias,
)
from hybridmoe.quant.expert_weights import ExpertWeights
from hybridmoe.quant.formats import WeightFormat, dense_format
from hybridmoe.quant.stacking import quantize_into


class ExpertBank:
    """One layer's routed experts: gate and up [E, I, H] in `gate_up_fmt` (one format for both:
    they are computed side by side) and down [E, H, I] in `down_fmt`, which may differ (a
    Q4_K_M GGUF stores Q4_K gate/up beside Q6_K down). `formats` is the pair; `fmt` the one
    format of a bank whose projections share it.

    Built from one stacked gate_up [E, 2I, H] (gate rows, then up rows: `ExpertBank(gate_up,
    down, fmt)`, what stacking a checkpoint makes) or from two separate tensors
    (`ExpertBank(gate=..., up=..., down=..., fmt=...)`, e.g. a GGUF file's merged
    ffn_gate_exps / ffn_up_exps, memory-mapped, which become the bank without a copy). A
    stacked bank's gate and up are views of its gate_up: it fetches an expert's gate and up
    rows in one copy and computes them in one GEMM. Every value either kind computes is the
    same dot product of the same stored row, so both give the same results.
    """

    def __init__(
        self,
        gate_up: torch.Tensor | None = None,
        down: torch.Tensor | None = None,
        fmt: WeightFormat | None = None,
        *,
        gate: torch.Tensor | None = None,
        up: torch.Tensor | None = None,
        down_fmt: WeightFormat | None = None,
        biases: ExpertBiases | None = None,
        activation: ExpertActivation = SILU,
        activation_quant: str = "none",
    ) -> None:
        """`fmt`: gate and up's format (None: the dense format of their dtype); `down_fmt`:
        down's (None: `fmt` when given, else the dense format of down's dtype). TypeError
        unless given exactly one of gate_up or (gate, up), and down; ValueError for shapes
        that do not pair. `biases` and `activation`: what the experts compute besides their
        matrices (quant/expert_math.py); they travel with the bank (slots, copies, devices),
        as does `activation_quant` ("none", or "q8": its int8-block projections compute by
        quant/activation_q8.py's contract, on every path)."""
        if down is None or (gate_up is None) == (gate is None or up is None):
            raise TypeError("ExpertBank takes down and either gate_up, or both gate and up")
        if gate_up is not None:
            if gate is not None or up is not None or gate_up.dim() != 3 or gate_up.shape[1] % 2:
                raise ValueError(
                    f"ExpertBank: gate_up {tuple(gate_up.shape)} is not [E, 2I, H], "
                    "or gate/up were given too"
                )
            inter = gate_up.shape[1] // 2
            gate, up = gate_up[:, :inter], gate_up[:, inter:]  # [E, I, H] views each
        if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
            raise ValueError(
                f"ExpertBank: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                f"{up.dtype} must have one shape, dtype and device"
            )
        self.gate, self.up, self.down = gate, up, down
        self._gate_up = gate_up
        self.biases, self.activation = biases, activation
        if biases is not None and tuple(biases.gate_up.shape) != (gate.shape[0], 2 * gate.shape[1]):
            raise ValueError(
                f"ExpertBank: gate_up biases {tuple(biases.gate_up.shape)} do not match "
                f"{gate.shape[0]} experts of width {gate.shape[1]}"
            )
        self.gate_up_fmt = fmt if fmt is not None else dense_format(gate.dtype)
        if down_fmt is None:
            down_fmt = fmt if fmt is not None else dense_format(down.dtype)
        self.down_fmt = down_fmt
        activation_q8.check_formats(activation_quant, self.formats)
        self.activation_quant = activation_quant
        self._byte_views: tuple | None = None
        self._flat_biases: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._check_stored_shapes()

    def _check_stored_shapes(self) -> None:
        """ValueError unless gate/up [E, I, row(H)] are what gate_up_fmt stores for H and down
        [E, H, row(I)] what down_fmt stores for I (whole blocks of it), in its storage dtype."""
        if self.down.dim() != 3 or self.gate.dim() != 3:
            raise ValueError(
                f"ExpertBank: gate {tuple(self.gate.shape)} and down {tuple(self.down.shape)} "
                "are not [E, rows, stored row]"
            )
        num, hidden, inter = self.num_experts, self.hidden_size, self.intermediate_size
        for name, tensor, fmt, rows, row in (
            ("gate/up", self.gate, self.gate_up_fmt, inter, hidden),
            ("down", self.down, self.down_fmt, hidden, inter),
        ):
            fmt.check_row_length(row, f"ExpertBank: {name} rows of {fmt.name}")
            expected = fmt.stored_shape((num, rows, row))
            if tuple(tensor.shape) != expected or tensor.dtype != fmt.storage_dtype:
                raise ValueError(
                    f"ExpertBank: {name} {tuple(tensor.shape)} {tensor.dtype} does not hold "
                    f"E, H, I = {num, hidden, inter} in {fmt.name}: expected {expected} "
                    f"{fmt.storage_dtype}"
                )

    def __repr__(self) -> str:
        layout = "stacked" if self.stacked else "separate"
        shape = (self.num_experts, self.hidden_size, self.intermediate_size)
        names = "/".join(dict.fromkeys(f.name for f in self.formats))
        return f"ExpertBank({names}, E, H, I = {shape}, {layout} gate/up, {self.device})"

    @property
    def formats(self) -> tuple[WeightFormat, WeightFormat]:
        """(gate_up_fmt, down_fmt)."""
        return self.gate_up_fmt, self.down_fmt

    @property
    def fmt(self) -> WeightFormat:
        """The format of every projection; ValueError for a bank whose down differs (read
        gate_up_fmt and down_fmt there)."""
        if self.gate_up_fmt != self.down_fmt:
            raise ValueError(
                f"this ExpertBank stores gate/up as {self.gate_up_fmt.name} and down as "
                f"{self.down_fmt.name}: it has no one format"
            )
        return self.gate_up_fmt

    @property
    def is_quantized(self) -> bool:
        """Whether any projection is stored in blocks of more than one weight."""
        return self.gate_up_fmt.is_quantized or self.down_fmt.is_quantized

    @property
    def stacked(self) -> bool:
        """Whether gate and up are the two halves of one gate_up tensor."""
        return self._gate_up is not None

    @property
    def gate_up(self) -> torch.Tensor:
        """The stacked [E, 2I, H] gate and up rows; ValueError for a bank holding them apart."""
        if self._gate_up is None:
            raise ValueError("this ExpertBank holds gate and up in separate tensors: no gate_up")
        return self._gate_up

    @property
    def device(self) -> torch.device:
        return self.down.device

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.down.shape[1]  # down's rows are never packed

    @property
    def intermediate_size(self) -> int:
        return self.gate.shape[1]

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert occupies (what fetching it copies), its biases included."""
        bias_bytes = 0 if self.biases is None else self.biases.nbytes_per_expert
        experts = max(self.down.shape[0], 1)  # from the shapes: no view made (asked per fetch)
        return (self.gate.nbytes + self.up.nbytes + self.down.nbytes) // experts + bias_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole bank, its biases included."""
        bias_bytes = sum(t.nbytes for t in self.bias_tensors())
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes + bias_bytes

    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding the bank's bytes, each once: [gate_up, down] when stacked, else
        [gate, up, down] (what page-locking and copying a whole bank go through)."""
        return [self._gate_up, self.down] if self.stacked else [self.gate, self.up, self.down]

    def bias_tensors(self) -> list[torch.Tensor]:
        """The biases' tensors ([] without biases): page-locked with the bank's tensors."""
        return [] if self.biases is None else self.biases.tensors()

    def compute_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        """The dtype the experts' projections are computed in for activations of `act_dtype`:
        `act_dtype` when every projection stores exactly that dtype, else float32, in which every
        stored format (quantised blocks, f32, bf16) expands exactly. Either way each
        projection's output is then rounded to `act_dtype` (the accumulation contract)."""
        return act_dtype if self._stores_exactly(act_dtype) else torch.float32

    def _stores_exactly(self, dtype: torch.dtype) -> bool:
        """Whether every projection is stored as plain `dtype` values."""
        return all(not f.is_quantized and f.storage_dtype == dtype for f in self.formats)

    def expert_mlp(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        """h [n, H] -> down(act(gate h, up h)) [n, H] in h's dtype; each projection from the
        exact weights, its output rounded to h's dtype; biases and activation as
        quant/expert_math.py's contract says."""
        biases, activation = self.biases, self.activation
        if self.q8_activations:
            return self._q8_expert_mlp(h, expert)
        if self._stores_exactly(h.dtype):  # no casts to make
            gate, up = self._gate_up_linear(h, expert, h.dtype)  # 2 x [n, I]
            act = activate(gate, up, expert, biases, activation)
            return add_down_bias(F.linear(act, self.down[expert]), expert, biases)
        dtype = self.compute_dtype(h.dtype)  # float32: every stored value expands exactly
        gate, up = (p.to(h.dtype) for p in self._gate_up_linear(h.to(dtype), expert, dtype))
        act = activate(gate, up, expert, biases, activation).to(dtype)
        out = F.linear(act, self.down_weights(expert, dtype)).to(h.dtype)
        return add_down_bias(out, expert, biases)

    @property
    def q8_activations(self) -> bool:
        """Whether the projections compute by the q8 contract (activation_quant q8 on
        int8-block formats: quant/activation_q8.py)."""
        return activation_q8.uses_q8(self.activation_quant, self.gate_up_fmt)

    def _q8_expert_mlp(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        """expert_mlp by the q8 contract: each projection's float32 output rounded to h's
        dtype, as the float path's."""
        gate_up = [self.gate[expert], self.up[expert]]
        gate, up = (activation_q8.q8_linear(h, w, self.gate_up_fmt).to(h.dtype) for w in gate_up)
        act = activate(gate, up, expert, self.biases, self.activation)
        out = activation_q8.q8_linear(act, self.down[expert], self.down_fmt).to(h.dtype)
        return add_down_bias(out, expert, self.biases)

    def _gate_up_linear(
        self, h: torch.Tensor, expert: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate h, up h) [n, I] each in `dtype` (h's): one GEMM over the stacked rows, else one
        per projection, expanding one projection at a time."""
        if self.stacked:
            return F.linear(h, self.gate_up_weights(expert, dtype)).chunk(2, dim=-1)
        gate = F.linear(h, self.gate_weights(expert, dtype))
        return gate, F.linear(h, self.up_weights(expert, dtype))

    def gate_up_weights(self, expert: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A stacked bank's gate_up [2I, H] of expert `expert` as `dtype` (a view when already
        so stored); for a tensor of n expert indices (on the bank's device), [n, 2I, H]."""
        return _as_float(self.gate_up_fmt, self.gate_up[expert], dtype)

    def gate_weights(self, expert: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s gate [I, H] as `dtype` (a view when already so stored); for a
        tensor of n expert indices, their gate [n, I, H]."""
        return _as_float(self.gate_up_fmt, self.gate[expert], dtype)

    def up_weights(self, expert: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """As gate_weights, for up [I, H]."""
        return _as_float(self.gate_up_fmt, self.up[expert], dtype)

    def down_weights(self, expert: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s down [H, I] as `dtype` (a view when already so stored); for a
        tensor of n expert indices, their down [n, H, I]."""
        return _as_float(self.down_fmt, self.down[expert], dtype)

    def flat_float32_biases(self, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The biases (gate_up [E*2I], down [E*H]) flat in float32 holding their values as
        `act_dtype` holds them (cast to it, then widened exactly), for the fused CPU kernel
        (host banks with biases only); made once per dtype."""
        if act_dtype not in self._flat_biases:
            self._flat_biases[act_dtype] = tuple(
                t.to(act_dtype).to(torch.float32).contiguous().view(-1)
                for t in self.biases.tensors()
            )
        return self._flat_biases[act_dtype]

    def byte_views(self) -> tuple:
        """(gate, up, expert_rows, down) for the fused CPU kernel (host banks only): flat
        uint8 numpy arrays over the bank's memory, expert e's gate rows starting at row
        e * expert_rows of `gate` (rows of row_bytes(H)), its up rows likewise in `up`, its
        down rows at row e * H of `down`. A stacked bank's gate and up are one array's bytes
        (up starting I rows in) with expert_rows 2I; a bank holding them apart has
        expert_rows I."""
        if self._byte_views is None:
            flat = [_flat_bytes(t) for t in self.tensors()]
            inter, down = self.intermediate_size, flat[-1]
            if self.stacked:
                row_bytes = self._gate_up.shape[2] * self._gate_up.element_size()
                gate, up = flat[0], flat[0][inter * row_bytes :]
                self._byte_views = (gate, up, 2 * inter, down)
            else:
                self._byte_views = (flat[0], flat[1], inter, down)
        return self._byte_views

    def converted(self, fmt: WeightFormat) -> ExpertBank:
        """A new bank holding these experts in `fmt`, laid out as this one: a dense bank's
        tensors go to fmt's quantiser whole, as stored (the quantisers read bf16 and f32
        directly; one call a tensor), a quantised bank's are expanded to float32 one expert
        at a time first. ValueError if H or I is not a whole number of fmt's blocks."""
        fmt.check_row_length(self.hidden_size, "hidden_size (gate/up rows)")
        fmt.check_row_length(self.intermediate_size, "moe_intermediate_size (down rows)")
        out = self._empty_like((fmt, fmt), self.num_experts, self.device, with_biases=False)
        sources = zip(self.tensors(), self._tensor_formats(), out.tensors(), strict=True)
        for source, source_fmt, target in sources:
            if not source_fmt.is_quantized:
                quantize_into(fmt, source, target)  # [E, rows, n] in one call
                continue
            for expert in range(self.num_experts):
                quantize_into(fmt, _float_rows(source_fmt, source[expert]), target[expert])
        out.biases = self.biases  # biases are never quantised
        return out

    def _tensor_formats(self) -> list[WeightFormat]:
        """The format of each of tensors(), in its order."""
        gate_up = [self.gate_up_fmt] * (len(self.tensors()) - 1)
        return [*gate_up, self.down_fmt]

    def _empty_like(
        self,
        formats: tuple[WeightFormat, WeightFormat],
        num: int,
        device,
        with_biases: bool = True,
    ) -> ExpertBank:
        """Uninitialised storage for `num` experts of this bank's shapes in `formats`
        (gate_up's, down's), laid out as this bank (stacked or not), on `device`, with this
        bank's activation and (zero) biases when it has them and `with_biases`."""
        hidden, inter = self.hidden_size, self.intermediate_size
        gate_up_fmt, down_fmt = formats
        down = self.empty_like_tensor(down_fmt, (num, hidden, inter), device)
        with_biases = with_biases and self.biases is not None
        extras = dict(
            down_fmt=down_fmt,
            biases=self.biases.empty(num, device) if with_biases else None,
            activation=self.activation,
            activation_quant=self.activation_quant,
        )
        if self.stacked:
            gate_up = self.empty_like_tensor(gate_up_fmt, (num, 2 * inter, hidden), device)
            return ExpertBank(gate_up, down, gate_up_fmt, **extras)
        gate, up = (
            self.empty_like_tensor(gate_up_fmt, (num, inter, hidden), device) for _ in range(2)
        )
        return ExpertBank(gate=gate, up=up, down=down, fmt=gate_up_fmt, **extras)

    def empty_slots(self, num_slots: int, device: torch.device | str) -> ExpertBank:
        """A zero-filled bank of `num_slots` experts in this bank's formats and layout, on
        `device`."""
        slots = self._empty_like(self.formats, num_slots, device)
        for tensor in slots.tensors():
            tensor.zero_()
        return slots

    def expert_copies(
        self, expert: int, slots: ExpertBank, slot: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source, destination) pairs that copy expert `expert`'s stored bytes into slot `slot`
        of `slots` (same format), for Platform.start_copies: each pair contiguous."""
        return [(src[expert], dst[slot]) for src, dst in self.expert_tensor_pairs(slots)]

    def expert_tensor_pairs(self, slots: ExpertBank) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(this bank's tensor, the slots' tensor) pairs whose rows [expert] and [slot] hold
        one expert's stored bytes, biases included: expert_copies' pairs, for a caller that
        copies many experts to index itself."""
        pairs = self._pairs(slots)
        if self.biases is not None:
            pairs += self.biases.tensor_pairs(slots.biases)
        return pairs

    def copies_into(self, target: ExpertBank) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source, destination) pairs that copy the whole bank, biases included, into
        `target` (same format and shapes), for Platform.start_copies; contiguous pairs when
        both share a layout."""
        return self._pairs(target) + list(
            zip(self.bias_tensors(), target.bias_tensors(), strict=True)
        )

    def _pairs(self, other: ExpertBank) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if other.formats != self.formats:
            raise ValueError(f"cannot copy the bytes of {self} into {other}: formats differ")
        if self.stacked and other.stacked:
            return list(zip(self.tensors(), other.tensors(), strict=True))
        return [(self.gate, other.gate), (self.up, other.up), (self.down, other.down)]

    def in_own_pages(self) -> ExpertBank:
        """This bank copied into memory pages no other allocation shares (each tensor starts a
        page and its size is rounded up to whole pages): page-locking registers whole pages,
        and a second registration that touches an already locked page is refused."""
        return self._with(_in_own_pages)

    def to(self, device: torch.device | str) -> ExpertBank:
        """This bank on `device` (itself when already there)."""
        if self.device == torch.device(device):
            return self
        return self._with(lambda tensor: tensor.to(device))

    def _with(self, place) -> ExpertBank:
        """A bank of the same layout and format holding place(tensor) for each tensor."""
        placed = [place(tensor) for tensor in self.tensors()]
        biases = None if self.biases is None else self.biases.placed(place)
        gate_up_fmt, down_fmt = self.formats
        extras = dict(
            down_fmt=down_fmt,
            biases=biases,
            activation=self.activation,
            activation_quant=self.activation_quant,
        )
        if self.stacked:
            return ExpertBank(*placed, gate_up_fmt, **extras)
        gate, up, down = placed
        return ExpertBank(gate=gate, up=up, down=down, fmt=gate_up_fmt, **extras)

    def with_activation_quant(self, activation_quant: str) -> ExpertBank:
        """This bank's bytes (no copy) with `activation_quant` (ValueError as the
        constructor's)."""
        return self._with(lambda tensor: tensor)._set_activation_quant(activation_quant)

    def _set_activation_quant(self, activation_quant: str) -> ExpertBank:
        activation_q8.check_formats(activation_quant, self.formats)
        self.activation_quant = activation_quant
        return self

    @staticmethod
    def empty_like_tensor(fmt: WeightFormat, shape: Sequence[int], device) -> torch.Tensor:
        """Uninitialised storage for a float weight of `shape` [..., n] in `fmt`; on the host
        advised onto huge pages (loader/huge_pages.advise_huge_pages: a bank is written whole
        at load, then streamed by every decode step)."""
        empty = torch.empty(fmt.stored_shape(tuple(shape)), dtype=fmt.storage_dtype, device=device)
        advise_huge_pages(empty)
        return empty

    @classmethod
    def stack(cls, experts: ExpertWeights, fmt: WeightFormat | None = None) -> ExpertBank:
        """A stacked bank holding the experts' gate/up [I, H] and down [H, I] matrices in
        `fmt` (None: their dtype's dense format); each matrix is read once and written straight
        into place (quantised when `fmt` is, from the matrix as stored: no float32 copy)."""
        num, (inter, hidden) = experts.num_experts, experts.gate[0].shape
        fmt = fmt if fmt is not None else dense_format(experts.gate[0].dtype)
        fmt.check_row_length(hidden, "hidden_size (gate/up rows)")
        fmt.check_row_length(inter, "moe_intermediate_size (down rows)")
        gate_up = cls.empty_like_tensor(fmt, (num, 2 * inter, hidden), "cpu")  # [E, 2I, H]
        down = cls.empty_like_tensor(fmt, (num, hidden, inter), "cpu")  # [E, H, I]
        for e in range(num):  # each matrix read once, written into its rows (quantize_into)
            quantize_into(fmt, experts.gate[e], gate_up[e, :inter])
            quantize_into(fmt, experts.up[e], gate_up[e, inter:])
            quantize_into(fmt, experts.down[e], down[e])
        return cls(gate_up, down, fmt, biases=experts.biases, activation=experts.activation)

    def views(self) -> ExpertWeights:
        """Per-expert views of this (dense) bank's matrices, with its biases and activation."""
        return ExpertWeights(
            list(self.gate), list(self.up), list(self.down), self.biases, self.activation
        )


def _flat_bytes(tensor: torch.Tensor):
    """A contiguous tensor's bytes as a flat uint8 numpy array over the same memory."""
    if not tensor.is_contiguous():
        raise ValueError(f"ExpertBank: a {tuple(tensor.shape)} tensor is not contiguous")
    return tensor.view(torch.uint8).reshape(-1).numpy()


def _in_own_pages(tensor: torch.Tensor) -> torch.Tensor:
    page = mmap.PAGESIZE
    nbytes = tensor.numel() * tensor.element_size()
    raw = torch.empty(-(-nbytes // page) * page + page, dtype=torch.uint8)  # [whole pages + 1]
    start = -raw.data_ptr() % page
    owned = raw[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
    owned.copy_(tensor)
    return owned


def _float_rows(fmt: WeightFormat, stored: torch.Tensor) -> torch.Tensor:
    """Stored rows [..., row_bytes] as a float tensor a quantiser reads: themselves when dense,
    else expanded to float32."""
    return stored if not fmt.is_quantized else fmt.dequantize(stored, torch.float32)


def _as_float(fmt: WeightFormat, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows as `dtype`: themselves when so stored; a quantised format's expanded to
    float32 on the host by the kernels' dequantisers (the same values, in parallel, at memory
    speed: a prefill's dequantise-then-GEMM), else by fmt.dequantize."""
    if not fmt.is_quantized and stored.dtype == dtype:
        return stored
    if dtype == torch.float32 and fmt.is_quantized and stored.is_cpu:
        from hybridmoe.kernels.numba_dequantize import float32_weights  # loads numba

        return float32_weights(fmt, stored)
    return fmt.dequantize(stored, dtype)
