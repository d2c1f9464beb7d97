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
import torch.nn.functional as F

from hybridmoe.moe.host_banks import HostExpertBank

# Bound on the dequantised weights one chunk of routes gathers (per projection).
GATHER_CHUNK_BYTES = 256 * 2**20


def gathered_moe(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, bank: HostExpertBank
) -> torch.Tensor:
    """Σ_k w[t,k] · down_e(silu(gate_e x_t) ⊙ up_e x_t) with e = expert_ids[t,k]; ids < 0
    contribute nothing. x [T, H], expert_ids [T, K], weights [T, K], all on the bank's device
    -> [T, H] in x's dtype, computed in x's dtype. Never reads a tensor on the host."""
    tokens, top_k = expert_ids.shape
    routes, hidden = tokens * top_k, x.shape[1]
    valid = (expert_ids >= 0).reshape(routes, 1)  # [R, 1]
    ids = expert_ids.clamp(min=0).reshape(routes)  # [R]; route r = t * K + k
    x_routes = x.repeat_interleave(top_k, dim=0)  # [R, H]
    y_routes = torch.empty(routes, hidden, dtype=x.dtype, device=x.device)  # [R, H]
    expert_bytes = 3 * bank.intermediate_size * hidden * x.element_size()
    chunk = max(1, GATHER_CHUNK_BYTES // expert_bytes)
    for start in range(0, routes, chunk):
        rows = slice(start, start + chunk)
        y_routes[rows] = _routes_mlp(x_routes[rows], ids[rows], bank)
    weighted = torch.where(valid, y_routes * weights.reshape(routes, 1).to(x.dtype), 0)
    return weighted.view(tokens, top_k, hidden).sum(dim=1)


def _routes_mlp(x: torch.Tensor, ids: torch.Tensor, bank: HostExpertBank) -> torch.Tensor:
    """x [c, H], ids [c] -> down(silu(gate x) * up x) [c, H], route by route."""
    gate_up = bank.gate_up_weights(ids, x.dtype)  # [c, 2I, H]
    gate, up = torch.bmm(gate_up, x[:, :, None])[..., 0].chunk(2, dim=-1)  # 2 x [c, I]
    down = bank.down_weights(ids, x.dtype)  # [c, H, I]
    return torch.bmm(down, (F.silu(gate) * up)[:, :, None])[..., 0]
