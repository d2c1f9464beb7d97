"""Routed expert math on a ExpertBank, run by the CPU worker; a registry of kernels.

`bank_moe` is the pure-torch reference: the same sum as `moe_reference` (layers/moe.py), per
expert one GEMM over its stacked gate_up rows (or one each for gate and up when the bank holds
them apart), the expert's weights dequantised first when the bank is quantised.
`fused_cpu_moe` is the fast path: for up to FUSED_MAX_TOKENS tokens one numba call per layer
reads each weight row once for all tokens (kernels/numba_moe.py); beyond that (prefill)
compute dominates and the dequantise-then-GEMM reference is the better kernel.
Kernels are registered by name in CPU_EXPERT_FNS; their factories import them lazily.

Every kernel keeps the accumulation contract (docs/architecture.md): it returns the float32
partial sum [T, H], which the MoE layer rounds to the activation dtype once.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from hybridmoe.moe.routing import combine_experts
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.registry import registering

# (x [T, H], expert_ids [T, K], weights [T, K], bank) -> float32 partial [T, H]; ids < 0 skipped
CpuExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertBank], torch.Tensor]

# kernel name -> factory(threads); a factory imports its optional dependency when called
CPU_EXPERT_FNS: dict[str, Callable[[int | None], CpuExpertFn]] = {}

FUSED_MAX_TOKENS = 16  # fused_cpu_moe's fused kernel up to this many tokens; beyond: bank_moe


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
    -> the float32 partial [T, H]. IndexError for an expert id >= the bank's experts."""
    tokens, top_k = expert_ids.shape
    if tokens > FUSED_MAX_TOKENS:
        return bank_moe(x, expert_ids, weights, bank)
    if bank.q8_activations:  # the q8 contract's kernel, compiled only for such banks
        from hybridmoe.kernels.numba_moe_q8 import run_fused_moe_q8 as run_fused_moe
    else:
        from hybridmoe.kernels.numba_moe import run_fused_moe

    hidden, inter, num_experts = bank.hidden_size, bank.intermediate_size, bank.num_experts
    x32 = _flat_array(x, np.float32)  # [T*H]
    ids64 = _flat_array(expert_ids, np.int64)  # [T*K]
    w32 = _flat_array(weights, np.float32)  # [T*K]
    y_flat = np.zeros(tokens * hidden, np.float32)  # [T*H], accumulated by the kernel
    gate, up, expert_rows, down = bank.byte_views()  # stacked or separate gate and up
    act_bf16 = _bf16_rounding(x.dtype, weights.dtype)
    args = (x32, ids64, w32, gate, up, expert_rows, down, hidden, inter, num_experts, top_k)
    formats = (bank.gate_up_fmt.name, bank.down_fmt.name)
    extras = (act_bf16, _activation_args(bank), *_bias_arrays(bank, x.dtype))
    bad_id = run_fused_moe(formats, threads, *args, *extras, y_flat)
    if bad_id >= 0:
        raise IndexError(f"expert id {bad_id} out of range: the bank has {num_experts} experts")
    return torch.from_numpy(y_flat.reshape(tokens, hidden))  # [T, H] float32


def _flat_array(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """Host tensor `t`'s values as a new flat numpy array of `dtype` (converted exactly: the
    kernel's inputs are float32 and int64). One torch op (copy_ into numpy's memory), where
    .to(...).numpy() are up to five: a decode step calls this per layer."""
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
