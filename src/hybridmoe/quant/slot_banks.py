"""SlotBanks: expert slots on a device that hold an expert of any layer, whatever its formats.

The decode cache shares one pool of slots between all MoE layers, and prefill's layer buffers
take one layer after another; but a GGUF file may store each layer's experts in other formats
(a Q4_K_M file: Q6_K down in some layers, Q4_K or Q5_K in others). So each projection's slot
storage is raw bytes, as many per slot as the largest of the layers' formats takes, and
`bank_for(bank)` is an ExpertBank over those same bytes in `bank`'s formats and layout: the
slots of that layer's experts. Slot s of each view is the first bytes of storage row s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.expert_math import ExpertBiases

SLOT_ALIGN_BYTES = 16  # each slot starts at a multiple of this in its projection's storage


class SlotBanks:
    """`num_slots` zero-filled expert slots on `device` for experts of any of `banks` (one
    layout, one shape; formats may differ). Views share the bytes: writing an expert into
    bank_for(a) overwrites what bank_for(b) reads in that slot."""

    def __init__(self, banks: Sequence[ExpertBank], num_slots: int, device: torch.device | str):
        self.num_slots, self.stacked = num_slots, banks[0].stacked
        self.storage = [  # per tensor of a bank (tensors()): uint8 [S, slot bytes]
            torch.zeros(num_slots, nbytes, dtype=torch.uint8, device=device)
            for nbytes in self.slot_tensor_bytes(banks)
        ]
        self.biases = self._slot_biases(banks, num_slots, device)
        self._views: dict[tuple, ExpertBank] = {}

    @staticmethod
    def _slot_biases(
        banks: Sequence[ExpertBank], num_slots: int, device: torch.device | str
    ) -> ExpertBiases | None:
        """Zero biases for the slots when the banks' experts have them, else None; every view
        shares them. ValueError as check_expert_kinds."""
        check_expert_kinds(banks)
        first = banks[0].biases
        return None if first is None else first.empty(num_slots, device)

    @staticmethod
    def slot_tensor_bytes(banks: Sequence[ExpertBank]) -> list[int]:
        """Bytes one slot takes in each tensor of a bank (gate_up and down, or gate, up and
        down): the largest expert of the banks' formats, rounded up to SLOT_ALIGN_BYTES."""
        per_bank = [[tensor[0].nbytes for tensor in bank.tensors()] for bank in banks]
        return [
            -(-max(sizes) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
            for sizes in zip(*per_bank, strict=True)
        ]

    @classmethod
    def slot_nbytes(cls, banks: Sequence[ExpertBank]) -> int:
        """Device bytes one slot for experts of `banks` takes."""
        return sum(cls.slot_tensor_bytes(banks))

    @property
    def nbytes(self) -> int:
        biases = [] if self.biases is None else self.biases.tensors()
        return sum(tensor.nbytes for tensor in [*self.storage, *biases])

    def bank_for(self, bank: ExpertBank) -> ExpertBank:
        """The slots as a bank in `bank`'s formats, layout and shapes (a view, made once per
        formats); ValueError for a bank the slots were not sized for."""
        key = (
            bank.formats,
            bank.activation_quant,
            bank.stacked,
            tuple(t.shape[1:] for t in bank.tensors()),
        )
        if key not in self._views:
            self._views[key] = self._view(bank)
        return self._views[key]

    def _view(self, bank: ExpertBank) -> ExpertBank:
        tensors = bank.tensors()
        if bank.stacked != self.stacked or len(tensors) != len(self.storage):
            raise ValueError(f"{bank}: its layout differs from the slots' (stacked={self.stacked})")
        views = []
        for tensor, storage in zip(tensors, self.storage, strict=True):
            nbytes = tensor[0].nbytes
            if nbytes > storage.shape[1]:
                raise ValueError(
                    f"{bank}: an expert takes more bytes than the slots were sized for"
                )
            # [S, nbytes] rows of stride slot bytes, as tensor's dtype and per-expert shape
            flat = storage[:, :nbytes].view(tensor.dtype)
            views.append(flat.view(self.num_slots, *tensor.shape[1:]))
        gate_up_fmt, down_fmt = bank.formats
        extras = dict(
            down_fmt=down_fmt,
            biases=self.biases,
            activation=bank.activation,
            activation_quant=bank.activation_quant,
        )
        if self.stacked:
            return ExpertBank(views[0], views[1], gate_up_fmt, **extras)
        gate, up, down = views
        return ExpertBank(gate=gate, up=up, down=down, fmt=gate_up_fmt, **extras)


def check_expert_kinds(banks: Sequence[ExpertBank]) -> None:
    """ValueError naming the first layer whose experts differ from layer 0's in their
    activation or biases (present or not, shapes, dtype): one set of slots holds one kind of
    expert, whichever layer it serves."""

    def kind(bank: ExpertBank) -> tuple:
        biases = bank.biases
        shapes = None if biases is None else [(t.shape[1:], t.dtype) for t in biases.tensors()]
        return bank.activation, shapes

    first = kind(banks[0])
    for layer, bank in enumerate(banks):
        if kind(bank) != first:
            raise ValueError(
                f"layer {layer}: bank experts ({bank.activation}, biases "
                f"{kind(bank)[1]}) differ from layer 0's ({first[0]}, biases {first[1]}); "
                "the shared slots hold one kind of expert"
            )
