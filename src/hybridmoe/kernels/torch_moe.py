"""The accelerator's decode expert math in plain torch: no host synchronisation, fixed shapes.

`bank_moe` (moe/cpu_experts.py), the reference, groups routes by expert on the host
(`tolist()`), which waits for the accelerator at every MoE layer and gives a different kernel
sequence for every routing pattern. `gathered_moe` computes the same sum route by route: each
route gathers its expert's stored weights by index on the device, dequantises them there when
the format is quantised, and runs a batched GEMV. Its shapes depend only on T and K, so a
decode step issues the same kernels whatever the routing (what graph capture needs), and the
host never reads the ids. It reads an expert once per route, so it is for decode's few routes;
prefill keeps the grouped reference.
"""

from __future__ import annotations

import torch

from hybridmoe.quant.activation_q8 import q8_bmm
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.expert_math import activate, add_down_bias
from hybridmoe.quant.formats import WeightFormat

# Bound on the expanded weights (all three projections) one chunk of routes gathers.
GATHER_CHUNK_BYTES = 256 * 2**20
# Device bytes per weight that expanding quantised blocks holds at once (quant/_blocks.py on an
# accelerator, one chunk): the float32 output, the unpacked uint8 values, and two float32
# intermediates of the unpack-shift-scale expression; rounded up from 13.
DEQUANT_BYTES_PER_WEIGHT = 14


def gathered_moe(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, bank: ExpertBank
) -> torch.Tensor:
    """Σ_k w[t,k] · down_e(silu(gate_e x_t) ⊙ up_e x_t) with e = expert_ids[t,k] (or the bank's
    activation and biases, gathered per route: quant/expert_math.py); ids < 0 contribute
    nothing. x [T, H], expert_ids [T, K], weights [T, K], all on the bank's device
    -> the float32 partial [T, H] of the accumulation contract (each route's MLP in x's dtype,
    the weighted sum over k in float32). Never reads a tensor on the host."""
    tokens, top_k = expert_ids.shape
    routes, hidden = tokens * top_k, x.shape[1]
    valid = (expert_ids >= 0).reshape(routes, 1)  # [R, 1]
    ids = expert_ids.clamp(min=0).reshape(routes)  # [R]; route r = t * K + k
    x_routes = x.repeat_interleave(top_k, dim=0)  # [R, H]
    y_routes = torch.empty(routes, hidden, dtype=x.dtype, device=x.device)  # [R, H]
    chunk = routes_per_chunk(bank, x.dtype)
    for start in range(0, routes, chunk):
        rows = slice(start, start + chunk)
        y_routes[rows] = _routes_mlp(x_routes[rows], ids[rows], bank)
    # in the promoted dtype of the route's output and its weight, as combine_experts
    weighted = (y_routes * weights.reshape(routes, 1)).float()  # [R, H]
    weighted = torch.where(valid, weighted, 0)
    return weighted.view(tokens, top_k, hidden).sum(dim=1)


def routes_per_chunk(bank: ExpertBank, act_dtype: torch.dtype) -> int:
    """Routes one chunk gathers: their expanded weights of all three projections fit
    GATHER_CHUNK_BYTES."""
    compute_bytes = bank.compute_dtype(act_dtype).itemsize
    return max(
        1, GATHER_CHUNK_BYTES // (3 * bank.intermediate_size * bank.hidden_size * compute_bytes)
    )


def gathered_moe_peak_bytes(
    bank: ExpertBank, tokens: int, top_k: int, act_dtype: torch.dtype
) -> int:
    """Peak device bytes of the temporaries one gathered_moe call over `tokens` x `top_k` routes
    allocates (its output excluded): the larger of its two phases for one chunk of routes
    (gate and up gathered and expanded in gate_up_fmt, at most both at once; then down in
    down_fmt), plus the per-route activations."""
    routes = tokens * top_k
    chunk = min(routes, routes_per_chunk(bank, act_dtype))
    hidden, inter = bank.hidden_size, bank.intermediate_size
    compute_dtype = bank.compute_dtype(act_dtype)
    gate_up = _gathered_bytes(
        bank.gate_up_fmt, chunk * 2 * inter * hidden, compute_dtype, chunk * 2 * bank.gate[0].nbytes
    )
    down = _gathered_bytes(
        bank.down_fmt, chunk * inter * hidden, compute_dtype, chunk * bank.down[0].nbytes
    )
    act_bytes = act_dtype.itemsize
    per_route = hidden * (2 * act_bytes + 2 * 4) + 2 * inter * (
        2 * act_bytes + compute_dtype.itemsize
    )
    if bank.biases is not None:  # each route's gathered biases, and their sums
        per_route += 2 * (2 * inter + hidden) * max(act_bytes, bank.biases.gate_up.itemsize)
    return max(gate_up, down) + routes * per_route


def _gathered_bytes(
    fmt: WeightFormat, weights: int, compute_dtype: torch.dtype, stored_bytes: int
) -> int:
    """Bytes of `weights` weights of `fmt` gathered (`stored_bytes`) and expanded to
    `compute_dtype`: blocks expanded with their temporaries, a dense dtype cast, or none."""
    if fmt.is_quantized:
        return stored_bytes + weights * DEQUANT_BYTES_PER_WEIGHT
    if fmt.storage_dtype != compute_dtype:
        return stored_bytes + weights * compute_dtype.itemsize  # a cast of the gathered rows
    return stored_bytes  # the gathered rows are the weights


def _routes_mlp(x: torch.Tensor, ids: torch.Tensor, bank: ExpertBank) -> torch.Tensor:
    """x [c, H], ids [c] -> down(act(gate x, up x)) [c, H] in x's dtype, route by route; each
    projection from the exact weights, its output rounded to x's dtype (as bank_moe), each
    route's biases gathered by its id. A bank with q8 activations computes each projection by
    quant/activation_q8.py's contract from the gathered stored rows."""
    if bank.q8_activations:
        return _q8_routes_mlp(x, ids, bank)
    dtype = bank.compute_dtype(x.dtype)
    gate, up = _gate_up_routes(x.to(dtype)[:, :, None], ids, bank, dtype)  # 2 x [c, I]
    gate, up = gate.to(x.dtype), up.to(x.dtype)
    act = activate(gate, up, ids, bank.biases, bank.activation).to(dtype)
    down = bank.down_weights(ids, dtype)  # [c, H, I]
    out = torch.bmm(down, act[:, :, None])[..., 0].to(x.dtype)  # [c, H]
    return add_down_bias(out, ids, bank.biases)


def _q8_routes_mlp(x: torch.Tensor, ids: torch.Tensor, bank: ExpertBank) -> torch.Tensor:
    """_routes_mlp of a bank with q8 activations: x [c, H], ids [c] -> [c, H] in x's dtype."""
    gate = q8_bmm(x, bank.gate[ids], bank.gate_up_fmt).to(x.dtype)  # [c, I]
    up = q8_bmm(x, bank.up[ids], bank.gate_up_fmt).to(x.dtype)  # [c, I]
    act = activate(gate, up, ids, bank.biases, bank.activation)
    out = q8_bmm(act, bank.down[ids], bank.down_fmt).to(x.dtype)  # [c, H]
    return add_down_bias(out, ids, bank.biases)


def _gate_up_routes(
    x: torch.Tensor, ids: torch.Tensor, bank: ExpertBank, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [c, H, 1] in `dtype`, ids [c] -> (gate x, up x) [c, I] each in `dtype`: one batched
    GEMV over a stacked bank's gate_up rows, else one per projection; each projection's
    gathered weights are freed before the next are expanded."""
    if bank.stacked:
        gate_up = bank.gate_up_weights(ids, dtype)  # [c, 2I, H]
        return torch.bmm(gate_up, x)[..., 0].chunk(2, dim=-1)
    gate = torch.bmm(bank.gate_weights(ids, dtype), x)[..., 0]  # [c, I]
    return gate, torch.bmm(bank.up_weights(ids, dtype), x)[..., 0]
