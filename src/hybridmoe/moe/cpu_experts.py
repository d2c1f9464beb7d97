"""Routed expert math on a ExpertBank, run by the CPU worker; a registry of kernels.

`bank_moe` is the pure-torch reference: the same sum as `moe_reference` (layers/moe.py), per
expert one GEMM over its stacked gate_up rows (or one each for gate and up when the bank holds
them apart), the expert's weights dequantised first when the bank is quantised.
`fused_cpu_moe` is the fast path: one numba call per layer reads each weight row once for all
the tokens routed to it (kernels/numba_moe.py), for up to FUSED_MAX_TOKENS tokens and for
longer batches (prefill) while the experts get few routes each (uses_fused_kernel); beyond
that the torch GEMM of the dequantised (or float) weights is the better kernel, except with q8
activations, whose reference is not a GEMM: their kernel (kernels/numba_moe_q8.py) takes
every batch.
Kernels are registered by name in CPU_EXPERT_FNS; their factories import them lazily.

Every kernel keeps the accumulation contract (docs/architecture.md): it returns the float32
partial sum [T, H], which the MoE layer rounds to the activation dtype once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from hybridmoe.kernels import glue
from hybridmoe.kernels.host_arrays import host_array
from hybridmoe.moe.routing import combine_experts
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.registry import registering

# (x [T, H], expert_ids [T, K], weights [T, K], bank) -> float32 partial [T, H]; ids < 0 skipped
CpuExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertBank], torch.Tensor]

# kernel name -> factory(threads); a factory imports its optional dependency when called
CPU_EXPERT_FNS: dict[str, Callable[[int | None], CpuExpertFn]] = {}

# fused_cpu_moe's fused kernel up to this many tokens (a decode step: on an accelerator
# GATHER_MAX_TOKENS follows it), and beyond them up to this many routes per expert on average:
# the kernel dequantises a weight tile once per 4 routes, bank_moe dequantises each expert once
# and multiplies by torch's GEMM, which wins on more routes; a float bank needs no dequantising.
# Measured side by side, 2 threads, bf16 activations (2026-12-03, AMD EPYC AVX-512), bank_moe's
# time / the kernel's at 4 / 16 / 64 / 256 routes an expert, ~1 GB model's layer: q4_k 7.1 /
# 3.2 / 1.4 / 1.1, q8_0 17 / 6.6 / 2.8 / 1.0, bf16 3.6 / 1.6 / 0.69 / 0.50; Qwen3-30B-A3B's at 8 /
# 32 / 128: q4_k 10.7 / 2.0 / 1.1, bf16 1.5 / 0.74 / 0.64.
FUSED_MAX_TOKENS = 16
FUSED_MAX_ROUTES_QUANTIZED = 128
FUSED_MAX_ROUTES_FLOAT = 16


def uses_fused_kernel(tokens: int, top_k: int, bank: ExpertBank) -> bool:
    """Whether fused_cpu_moe computes `tokens` tokens of `top_k` routes by the fused kernel (else
    bank_moe): up to FUSED_MAX_TOKENS, with q8 activations always, else while the mean routes
    per expert stay within the bank's kind's limit (quantised: either projection's format)."""
    if tokens <= FUSED_MAX_TOKENS or bank.q8_activations:
        return True
    quantized = bank.gate_up_fmt.is_quantized or bank.down_fmt.is_quantized
    limit = FUSED_MAX_ROUTES_QUANTIZED if quantized else FUSED_MAX_ROUTES_FLOAT
    return tokens * top_k <= limit * bank.num_experts


def register_cpu_expert_fn(
    name: str,
) -> Callable[[Callable[[int | None], CpuExpertFn]], Callable[[int | None], CpuExpertFn]]:
    """Decorator: register a factory(threads) that returns a CpuExpertFn under `name`."""
    return registering(CPU_EXPERT_FNS, "CPU expert kernel", name)


def create_cpu_expert_fn(name: str = "numba", threads: int | None = None) -> CpuExpertFn:
    """The CPU expert kernel registered as `name`, computing on `threads` threads (None: the
    kernel's default, every usable core)."""
    if name not in CPU_EXPERT_FNS:
        choices = ", ".join(sorted(CPU_EXPERT_FNS))
        raise ValueError(f"unknown CPU expert kernel {name!r}; choose one of: {choices}")
    return CPU_EXPERT_FNS[name](threads)


def bank_moe(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, bank: ExpertBank
) -> torch.Tensor:
    """Σ_k w[t,k] · down_e(silu(gate_e x_t) ⊙ up_e x_t) with e = expert_ids[t,k]; ids < 0 skipped
    (or the bank's activation and biases: quant/expert_math.py).

    x [T, H], expert_ids [T, K], weights [T, K], all on the bank's device -> the float32
    partial [T, H] of the accumulation contract (each expert's MLP in x's dtype, the weighted
    sum in float32). For a dense bank of x's dtype it equals `moe_reference` on the bank's
    views up to summation order.
    """
    return combine_experts(x, expert_ids, weights, bank.expert_mlp)


def fused_cpu_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    bank: ExpertBank,
    threads: int | None = None,
) -> torch.Tensor:
    """The same sum as `bank_moe`, on a host bank of any format, on `threads` threads, with
    the same rounding points (and, for a bank with q8 activations, the same contract:
    quant/activation_q8.py); x [T, H] (float32 or bfloat16), expert_ids [T, K], weights [T, K]
    -> the float32 partial [T, H]. IndexError for an expert id >= the bank's experts.
    A decode step calls it once per layer: what does not change for a bank is prepared once
    (_BankCall), inputs already of the kernel's dtype are passed as views (the kernel only
    reads them) and bf16 ones widened by a numba call: a call is 1 aten op (from_numpy's)."""
    tokens, top_k = expert_ids.shape
    if not uses_fused_kernel(tokens, top_k, bank):
        return bank_moe(x, expert_ids, weights, bank)
    call = _BANK_CALLS.get(bank) or _BankCall.of(bank)
    x32 = _kernel_array(x, torch.float32, np.float32)  # [T*H]
    ids64 = _kernel_array(expert_ids, torch.int64, np.int64)  # [T*K]
    w32 = _kernel_array(weights, torch.float32, np.float32)  # [T*K]
    y = np.zeros((tokens, call.hidden), np.float32)  # [T, H], accumulated by the kernel
    extras = call.extras(bank, x.dtype, weights.dtype)
    args = call.arguments(x32, ids64, w32, top_k, extras, y.reshape(-1))
    bad_id = call.numba_moe.launch(call.kernel, threads, *args)  # looked up per call: the
    if bad_id >= 0:  # counting benchmarks and tests replace numba_moe.launch
        raise IndexError(f"expert id {bad_id} out of range: the bank has {call.experts} experts")
    return torch.from_numpy(y)  # [T, H] float32


def block_experts(
    bank: ExpertBank,
    act_dtype: torch.dtype,
    weights_dtype: torch.dtype,
    tokens: int,
    top_k: int,
    expert_fn: CpuExpertFn,
) -> tuple | None:
    """What the attention block takes to compute `expert_fn`'s step on `bank` for `tokens`
    tokens of `top_k` routes in its own call (kernels/attention_block.decode_block's
    `experts`: the formats, the bank's arrays, the rounding and activation arguments, the
    thread count), the same arguments fused_cpu_moe hands its kernel; None unless
    `expert_fn` is fused_cpu_moe and would take the fused kernel."""
    threads = fused_kernel_threads(expert_fn)
    if threads is None or not uses_fused_kernel(tokens, top_k, bank):
        return None
    call = _BANK_CALLS.get(bank) or _BankCall.of(bank)
    return call.formats, call.weights, call.extras(bank, act_dtype, weights_dtype), threads


def fused_kernel_threads(expert_fn: CpuExpertFn) -> int | None:
    """The thread count of the fused kernel's launches when `expert_fn` is fused_cpu_moe
    (compiles_on_first_call), else None."""
    if not compiles_on_first_call(expert_fn):
        return None
    from hybridmoe.kernels.numba_moe import max_threads

    threads = expert_fn.keywords.get("threads") if isinstance(expert_fn, partial) else None
    return threads or max_threads()


class _BankCall:
    """What fused_cpu_moe hands the kernel for one bank, made on its first call: the entry
    point of its formats, its byte views and sizes, and per (activation, router weight)
    dtype the rounding code, activation and bias arrays. Holds no reference to the bank (the
    bank keys it in _BANK_CALLS, weakly); a bank's tensors never change (to() and the like
    make new banks)."""

    @classmethod
    def of(cls, bank: ExpertBank) -> _BankCall:
        call = _BANK_CALLS[bank] = cls(bank)
        return call

    def __init__(self, bank: ExpertBank):
        from hybridmoe.kernels import numba_moe

        self.numba_moe = numba_moe
        self.formats = (bank.gate_up_fmt.name, bank.down_fmt.name, bank.q8_activations)
        self.kernel = kernel_entry(self.formats)
        self.hidden, self.experts = bank.hidden_size, bank.num_experts
        gate, up, expert_rows, down = bank.byte_views()  # stacked or separate gate and up
        inter = bank.intermediate_size
        self.weights = (gate, up, expert_rows, down, self.hidden, inter, self.experts)
        self._extras: dict[tuple[torch.dtype, torch.dtype], tuple] = {}

    def arguments(self, x, ids, weights, top_k: int, extras: tuple, y) -> tuple:
        """The kernel's arguments: flat x and y [T * H], ids and weights [T * K] (numpy),
        `extras` of the call's dtypes."""
        return (x, ids, weights, *self.weights, top_k, *extras, y)

    def extras(self, bank: ExpertBank, act_dtype: torch.dtype, weights_dtype: torch.dtype):
        """(rounding code, activation args, gate_up bias, down bias) for these dtypes."""
        key = (act_dtype, weights_dtype)
        extras = self._extras.get(key)
        if extras is None:
            act_bf16 = _bf16_rounding(act_dtype, weights_dtype)
            extras = (act_bf16, _activation_args(bank), *_bias_arrays(bank, act_dtype))
            self._extras[key] = extras
        return extras


_BANK_CALLS: weakref.WeakKeyDictionary[ExpertBank, _BankCall] = weakref.WeakKeyDictionary()


def kernel_entry(formats: tuple[str, str, bool]):
    """The fused kernel's entry point (a numba dispatcher) for (gate/up format name, down
    format name, q8 activations), made on first use: the q8 contract's kernel only for banks
    with q8 activations."""
    gate_up_fmt, down_fmt, q8_activations = formats
    if q8_activations:
        from hybridmoe.kernels.numba_moe_q8 import fused_moe_q8_kernel

        return fused_moe_q8_kernel(gate_up_fmt, down_fmt)
    from hybridmoe.kernels.numba_moe import fused_moe_kernel

    return fused_moe_kernel(gate_up_fmt, down_fmt)


def kernel_signature(bank: ExpertBank) -> tuple[tuple[str, str, bool], tuple]:
    """(formats, argument types): what fused_cpu_moe's fused kernel compiles for `bank` (its
    entry point is kernel_entry(formats)); the types are numba's of the arguments a call
    hands it, the same for every activation dtype and token count (flat float32 and int64
    inputs, the bank's own byte views)."""
    import numba

    call = _BANK_CALLS.get(bank) or _BankCall.of(bank)
    x, y = np.zeros(call.hidden, np.float32), np.zeros(call.hidden, np.float32)
    ids, weights = np.zeros(1, np.int64), np.zeros(1, np.float32)
    args = call.arguments(x, ids, weights, 1, call.extras(bank, torch.float32, torch.float32), y)
    return call.formats, tuple(numba.typeof(a) for a in args)


def _kernel_array(t: torch.Tensor, dtype: torch.dtype, np_dtype: type[np.generic]) -> np.ndarray:
    """Host tensor `t` flat as `np_dtype` (`dtype` in torch) for the kernel: a view of its
    memory when it has that dtype and is contiguous (host_array: no aten op), a bfloat16
    tensor's widening by glue.float32_array (no aten op), else _flat_array's exact copy."""
    if t.dtype == dtype and t.is_contiguous():
        return host_array(t, np_dtype)
    widened = glue.float32_array(t) if dtype is torch.float32 else None  # bf16: one numba call
    return _flat_array(t, np_dtype) if widened is None else widened


def _flat_array(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """Host tensor `t`'s values as a new flat numpy array of `dtype` (converted exactly: the
    kernel's inputs are float32 and int64). One torch op (copy_ into numpy's memory), where
    .to(...).numpy() are up to five."""
    out = np.empty(t.shape, dtype)
    torch.from_numpy(out).copy_(t)
    return out.reshape(-1)


def compiles_on_first_call(expert_fn: CpuExpertFn) -> bool:
    """Whether `expert_fn` is the numba kernel (fused_cpu_moe, as create_cpu_expert_fn("numba")
    makes it or bare), which compiles, or loads from the disk cache, on its first call per
    kind of bank: its user calls it once per kind before any timed call (CpuMoeExecutor)."""
    func = expert_fn.func if isinstance(expert_fn, partial) else expert_fn
    return func is fused_cpu_moe


def _activation_args(bank: ExpertBank) -> tuple:
    """(code, alpha, limit) of the bank's activation for the numba kernel; alpha and limit
    as float32, the precision torch computes them in (quant/expert_math.py)."""
    activation = bank.activation
    return (activation.code, np.float32(activation.alpha), np.float32(activation.limit))


def _bias_arrays(bank: ExpertBank, act_dtype: torch.dtype) -> tuple:
    """(gate_up [E*2I], down [E*H]) float32 numpy arrays of the bank's biases as the
    activation dtype holds them; empty without biases."""
    if bank.biases is None:
        return _NO_BIAS, _NO_BIAS
    return tuple(t.numpy() for t in bank.flat_float32_biases(act_dtype))


_NO_BIAS = np.zeros(0, np.float32)


def _bf16_rounding(act_dtype: torch.dtype, weights_dtype: torch.dtype) -> int:
    """The kernel's rounding code (kernels/numba_moe.py); it computes float32 or bf16 only."""
    from hybridmoe.kernels.numba_moe import BF16_ACTIVATIONS, BF16_ROUTE_WEIGHTS

    if act_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(
            f"the numba CPU expert kernel computes float32 or bfloat16, not {act_dtype}"
        )
    if act_dtype == torch.float32:
        return 0
    return BF16_ROUTE_WEIGHTS if weights_dtype == torch.bfloat16 else BF16_ACTIVATIONS


@register_cpu_expert_fn("torch")
def _create_torch_expert_fn(threads: int | None) -> CpuExpertFn:
    # torch's intra-op threads are process-wide: the engine's `threads` setting governs them
    return bank_moe


@register_cpu_expert_fn("numba")
def _create_numba_expert_fn(threads: int | None) -> CpuExpertFn:
    from hybridmoe.kernels.numba_moe import max_threads

    if threads is not None and not 1 <= threads <= max_threads():
        raise ValueError(
            f"cpu_threads={threads}: the numba CPU expert kernel can use 1 to {max_threads()} "
            "threads on this machine (NUMBA_NUM_THREADS)"
        )
    return partial(fused_cpu_moe, threads=threads)
