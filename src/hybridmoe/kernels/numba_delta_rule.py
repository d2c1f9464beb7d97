"""The CPU decode step of the gated delta rule (layers/delta_rule.py): one token for each of B
sequences, every sequence's [heads, dk, dv] state updated in place in the cache's own rows.

Per (sequence, head) the state matrix S [dk, dv] is read twice and written twice while it
sits in cache (16-64 KiB), so a step moves it from memory about once: pass 1 decays S and
forms the prediction S^T k, pass 2 writes k u^T and reads S^T q. Every operation is the
reference's (recurrent_delta_rule), in float32, without fastmath (no reassociation, no fused
multiply-add), the decay exp(g) computed by torch, and both sums over dk in the order of
torch's cascade sum (partials of 16 rows folded level by level, as SumKernel.cpp's
multi_row_sum does): the kernel's results are the reference's bit for bit (tests/layers/
test_gated_deltanet.py checks that), so in bfloat16 too the tokens match transformers', whose
torch decode step is the reference's operations.

One thread: a step is ~1-2 MiB of state per layer at batch 4, less than numba's pool wake-up
costs on a loaded machine (see numba_dense.MIN_PARALLEL_BYTES).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from hybridmoe import env
from hybridmoe.kernels.numba_cache import cached_njit

_previous_cache_dir = numba.config.CACHE_DIR
numba.config.CACHE_DIR = str(env.kernel_cache_dir(__file__))


LEVELS = 4  # torch's cascade sum (aten/src/ATen/native/cpu/SumKernel.cpp, multi_row_sum)


@cached_njit(nogil=True)
def _level_power(n):
    """log2 of the rows torch's cascade sum adds into one level-0 partial, for n rows."""
    log2 = 0
    while (1 << log2) < n:
        log2 += 1
    return max(4, log2 // LEVELS)


@cached_njit(nogil=True)
def _carry(acc, rows_done, power):
    """After each full block of 2^power rows: each level's partial into the next, as far as
    rows_done is a multiple of that level's span."""
    for level in range(1, LEVELS):
        for j in range(acc.shape[1]):
            acc[level, j] += acc[level - 1, j]
            acc[level - 1, j] = 0
        if rows_done & (((1 << power) - 1) << (level * power)):
            break


@cached_njit(nogil=True)
def _total(acc, out):
    """out = ((acc0 + acc1) + acc2) + acc3, the partials' final fold."""
    for j in range(acc.shape[1]):
        total = acc[0, j]
        for level in range(1, LEVELS):
            total += acc[level, j]
        out[j] = total


@cached_njit(nogil=True)
def _step(q, k, v, decay, beta, state, rows, out):
    """q, k [B, Hk, dk], v [B, H, dv], decay, beta [B, H] float32 (value head h reads key head
    h // (H / Hk)); state [R, H, dk, dv] float32, rows [B] int64 (sequence b's state is
    state[rows[b]]); out [B, H, dv] float32. Both sums over dk in torch's cascade order."""
    B, H, dv = v.shape
    dk = k.shape[2]
    group, power = H // k.shape[1], _level_power(dk)
    acc = np.empty((LEVELS, dv), np.float32)
    update = np.empty(dv, np.float32)
    for b in range(B):
        for h in range(H):
            S = state[rows[b], h]  # [dk, dv], a view: written in place
            kh, d = h // group, decay[b, h]
            acc[:] = 0
            for i in range(dk):  # decay, and the prediction S^T k
                ki = k[b, kh, i]
                for j in range(dv):
                    s = S[i, j] * d
                    S[i, j] = s
                    acc[0, j] += s * ki
                if (i + 1) % (1 << power) == 0:
                    _carry(acc, i + 1, power)
            _total(acc, update)
            for j in range(dv):
                update[j] = (v[b, h, j] - update[j]) * beta[b, h]
            acc[:] = 0
            for i in range(dk):  # the write k u^T, then the read S^T q
                ki, qi = k[b, kh, i], q[b, kh, i]
                for j in range(dv):
                    s = S[i, j] + ki * update[j]
                    S[i, j] = s
                    acc[0, j] += s * qi
                if (i + 1) % (1 << power) == 0:
                    _carry(acc, i + 1, power)
            _total(acc, out[b, h])


numba.config.CACHE_DIR = _previous_cache_dir  # every cached function above is decorated


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """layers/delta_rule.delta_rule_step_torch's contract on host tensors (the state
    contiguous)."""
    if state.device.type != "cpu" or not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError(
            f"delta-rule kernel: the state must be contiguous float32 host memory, got a "
            f"{state.dtype} tensor on {state.device} (contiguous: {state.is_contiguous()})"
        )
    (B, Hk, dk), (H, dv) = k.shape, v.shape[1:]
    if state.shape[1:] != (H, dk, dv) or rows.shape != (B,) or H % Hk:
        raise ValueError(
            f"delta-rule kernel: state {tuple(state.shape)} and rows {tuple(rows.shape)} do "
            f"not fit k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    out = torch.empty(v.shape, dtype=torch.float32)
    host = [x.float().contiguous().numpy() for x in (q, k, v, g.exp(), beta)]
    _step(*host, state.numpy(), rows.contiguous().numpy(), out.numpy())
    return out
