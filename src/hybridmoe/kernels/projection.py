"""DenseProjection: one dense weight (+ bias) stored in a weight format, x -> x W^T + b.

On the CPU a decode step's few tokens (at most DECODE_MAX_TOKENS) go through the numba kernel
(kernels/numba_dense.py), which reads each weight row once for all tokens; anything else (a
long prefill, an accelerator) through torch (kernels/torch_dense.py). Both follow one
contract (float32 sums of the exact weights, the bias in float32, one rounding), so which one
ran moves a value only where float32 summation order tips a rounding; and every decode target
of a CPU machine shares these projections. A projection with q8 activations
(set_activation_quant: a format with integer dot products) follows quant/activation_q8.py's
contract instead, by its numba kernel (kernels/numba_dense_q8.py) for any number of tokens on
the CPU and torch's reference elsewhere. stack_rows makes several projections of one input
(a layer's q, k and v) one weight of concatenated rows: one call, one pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridmoe import env
from hybridmoe.kernels.torch_dense import dense_linear_torch
from hybridmoe.quant.activation_q8 import ACTIVATION_QUANTS
from hybridmoe.quant.formats import WeightFormat, dense_format

# tokens up to which the CPU kernel beats torch's GEMM (benchmarks/bench_dense.py)
DECODE_MAX_TOKENS = 16


class DenseProjection:
    """weight: the stored tensor in `fmt` ([out, in] for a dense format, [out, row bytes] of
    blocks for a block format); bias [out] in the activation dtype, or None."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        fmt: WeightFormat | None = None,
        in_features: int | None = None,
    ):
        self.weight, self.bias = weight, bias
        self.fmt = dense_format(weight.dtype) if fmt is None else fmt
        if in_features is None and self.fmt.is_quantized:
            raise ValueError(f"a {self.fmt.name} projection needs in_features")
        self.in_features = weight.shape[-1] if in_features is None else in_features
        self.out_features = weight.shape[0]
        self._host = None  # numba_dense.DenseCall for the CPU kernel, made on first use
        # "q8": each dot product by activation_q8's contract (set_activation_quant)
        self.activation_quant = "none"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        if self.uses_kernel(x):
            return self.kernel(x)
        return dense_linear_torch(x, self.weight, self.fmt, self.bias, self.activation_quant)

    def set_activation_quant(self, activation_quant: str) -> None:
        """Compute with q8 activations from now on where `activation_quant` is "auto" or "q8"
        and the format has integer dot products (q8_0, q4_0, the k-quants: as llama.cpp
        computes its quantised matmuls; quant/activation_q8.py), else with float activations
        ("none", or a float format)."""
        if activation_quant not in ACTIVATION_QUANTS:  # OffloadConfig's choices and words
            raise ValueError(
                f"activation_quant must be one of {', '.join(ACTIVATION_QUANTS)}, "
                f"got {activation_quant!r}"
            )
        chosen = "none" if activation_quant == "none" or not self.fmt.has_integer_dots else "q8"
        if chosen != self.activation_quant:
            self.activation_quant, self._host = chosen, None

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """__call__(x) by the CPU kernel, for an x that uses_kernel accepts (the caller checked:
        StackedQKV, where attention did)."""
        return (self._host or self._prepare())(x)

    def host_call(self):
        """The CPU kernel's numba_dense.DenseCall of this weight (for a kernel that calls the
        dense kernel itself: kernels/attention_block.py)."""
        return self._host or self._prepare()

    @property
    def prepared_call(self):
        """host_call()'s DenseCall where one was made and still holds, else None: a change of
        the weight or its arithmetic (quantize, to, stack_rows, set_activation_quant) drops
        it. A kernel keeping a call checks it is still this one (kernels/attention_block.py:
        ~1 µs where host_call() and the weight's device check took 3-4 on a decode step's
        cold caches)."""
        return self._host

    def route(
        self, x: torch.Tensor, top_k: int, renorm: bool, weights_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
        """This projection as a softmax router's gate, its step in one CPU kernel call
        (numba_dense.DenseCall.route): (ids, weights), or the logits __call__(x) gives where
        torch must route them, or None where the kernel does not take x (no bias; the
        caller then runs __call__ and routes)."""
        if not self._routable(x):
            return None
        return (self._host or self._prepare()).route(x, top_k, renorm, weights_dtype)

    def routes(self, x: torch.Tensor, top_k: int, weights_dtype: torch.dtype) -> bool:
        """Whether route(x, top_k, ...) takes the kernel step, for a kernel that computes it
        itself (kernels/attention_block.py: x of the gate's input's dtype and shape)."""
        return self._routable(x) and self.host_call().routes(x, top_k, weights_dtype)

    def _routable(self, x: torch.Tensor) -> bool:
        return self.bias is None and self.uses_kernel(x)

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether __call__(x) runs the CPU kernel (else torch): a decode step's few tokens, or
        any number with q8 activations (torch has no integer GEMM: its reference is a slow
        einsum)."""
        tokens = x.numel() // max(1, x.shape[-1])
        on_cpu = x.is_cpu and self.weight.is_cpu
        few = tokens <= DECODE_MAX_TOKENS or self.activation_quant == "q8"
        return on_cpu and few and env.dense_kernel()

    def _prepare(self):
        """The CPU kernel's call of this weight (its byte view, the float32 bias, the sizes),
        kept until the weight changes (quantize, to, stack_rows reset it)."""
        from hybridmoe.kernels import numba_dense  # numba loads on the first CPU decode

        bias_f32 = None if self.bias is None else self.bias.float().contiguous().numpy()
        w_bytes = numba_dense.weight_bytes(self.weight)
        call = numba_dense.DenseCall
        if self.activation_quant == "q8":
            from hybridmoe.kernels.numba_dense_q8 import q8_call as call
        self._host = call(self.fmt, w_bytes, self.out_features, self.in_features, bias_f32)
        return self._host

    def quantize(self, fmt: WeightFormat, dtype: torch.dtype | None = None) -> None:
        """Store the weight in `fmt` from now on (quantised by fmt.quantize from the stored
        values; a quantised weight's (a GGUF file's) dequantised to `dtype` first, float32 if
        None, as the file's loader would have read it); the bias stays. ValueError (naming the
        shape) if a row is not whole blocks."""
        fmt.check_row_length(self.in_features, f"a {tuple(self.weight.shape)} projection")
        weight = self.weight
        if self.fmt.is_quantized:
            weight = self.fmt.dequantize(weight, dtype or torch.float32)
        self.weight, self.fmt, self._host = fmt.quantize(weight), fmt, None
        self.activation_quant = "none"  # set again for the new format (set_activation_quant)

    def to(self, device: torch.device) -> None:
        self.weight = self.weight.to(device)
        self.bias = None if self.bias is None else self.bias.to(device)
        self._host = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]


def stack_rows(parts: Sequence[DenseProjection]) -> DenseProjection:
    """One projection whose output is `parts`' outputs side by side (rows stacked in order),
    over memory the parts share from then on: each part's weight (and bias) becomes a view of
    the stacked one's rows, so the weights are held once. On the CPU kernel its output's
    bits are the parts' (each output is one weight row's dot product, whatever the matrix;
    tests/layers/test_stacked_qkv.py); torch's GEMM gives no such promise, so callers use it
    where the parts would run the kernel (uses_kernel). The parts must share a format and
    in_features and device and all have a bias or none (ValueError naming what differs).
    Weights stored back to back in one storage (a GGUF's q, k and v: loader/gguf.py) are
    stacked as the view spanning them (adjacent_rows), not copied."""
    mismatch = _stack_mismatch(parts)
    if mismatch is not None:
        raise ValueError(f"stack_rows: {mismatch}")
    fmt, n, biased = parts[0].fmt, parts[0].in_features, parts[0].bias is not None
    weight = adjacent_rows([part.weight for part in parts])  # [sum of out, row]
    if weight is None:
        weight = torch.cat([part.weight for part in parts])
    bias = torch.cat([part.bias for part in parts]) if biased else None
    first = 0
    for part in parts:
        rows = slice(first, first + part.out_features)
        part.weight, part._host = weight[rows], None
        part.bias = None if bias is None else bias[rows]
        first += part.out_features
    stacked = DenseProjection(weight, bias, fmt, n)
    stacked.activation_quant = parts[0].activation_quant
    return stacked


def stackable(parts: Sequence[DenseProjection]) -> bool:
    """Whether stack_rows takes `parts` (a GGUF file may store a layer's q, k and v in
    different types: a Q4_K_M file's v in Q6_K beside Q4_K q and k)."""
    return _stack_mismatch(parts) is None


def _stack_mismatch(parts: Sequence[DenseProjection]) -> str | None:
    """What keeps `parts` from one stacked weight, or None."""
    fmt, n, device = parts[0].fmt, parts[0].in_features, parts[0].weight.device
    for part in parts:
        if part.fmt != fmt or part.in_features != n or part.weight.device != device:
            return (
                f"a {part.fmt.name} [{part.out_features}, {part.in_features}] projection on "
                f"{part.weight.device} beside a {fmt.name} [.., {n}] one on {device}"
            )
    if len({part.bias is not None for part in parts}) != 1:
        return "some projections have a bias and some do not"
    if len({part.activation_quant for part in parts}) != 1:
        return "some projections have q8 activations and some do not"
    return None


def adjacent_rows(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """torch.cat(weights) as a view, when the weights (contiguous, alike in dtype, device and
    row shape) lie back to back in one storage, in order: the same values, no copy; else
    None."""
    first = weights[0]
    storage = first.untyped_storage().data_ptr()
    end = first.storage_offset()
    for w in weights:
        alike = w.dtype == first.dtype and w.device == first.device and w.dim() == first.dim()
        if not (alike and w.shape[1:] == first.shape[1:] and w.is_contiguous()):
            return None
        if w.untyped_storage().data_ptr() != storage or w.storage_offset() != end:
            return None
        end += w.numel()
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
