"""The gated delta rule (Gated DeltaNet's linear attention), in float32.

Per value head, a state S [dk, dv] carries the sequence. Token t (key k_t, value v_t, query
q_t, log decay g_t <= 0, write strength beta_t in (0, 1)) does

    S <- exp(g_t) S                          decay
    u_t = beta_t (v_t - S^T k_t)             the part of v_t the state does not predict yet
    S <- S + k_t u_t^T                       delta-rule write
    o_t = S^T q_t                            read

`recurrent_delta_rule` is exactly that loop (the reference); `chunked_delta_rule` computes the
same over chunks of `chunk_tokens` positions with matrix products (the prefill form): inside a
chunk the writes solve one unit lower-triangular system. `delta_rule_step` is the decode form:
one token for each of B sequences, their states updated in place in the cache's rows (the
numba kernel kernels/numba_delta_rule.py on the CPU, `delta_rule_step_torch` elsewhere).
"""

from __future__ import annotations

import torch

from hybridmoe.kernels import numba_delta_rule

CHUNK_TOKENS = 64  # transformers' chunk size for the torch prefill form


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., D] / sqrt(sum x^2 + eps) (the FLA convention transformers follows)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time. q, k [B, H, T, dk], v [B, H, T, dv], g, beta [B, H, T], state
    [B, H, dk, dv] or None (zeros); all float32, q already scaled. Returns (o [B, H, T, dv],
    the final state [B, H, dk, dv]); `state` is not modified."""
    B, H, T, dk = k.shape
    S = k.new_zeros(B, H, dk, v.shape[-1]) if state is None else state.float()
    out = torch.empty_like(v)
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        predicted = (S * k[:, :, t, :, None]).sum(dim=-2)  # [B, H, dv]
        update = (v[:, :, t] - predicted) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * update[:, :, None, :]
        out[:, :, t] = (S * q[:, :, t, :, None]).sum(dim=-2)
    return out, S


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """delta_rule_step_torch's contract; on the CPU by the numba kernel (same float32 sums in
    the same order, see kernels/numba_delta_rule.py)."""
    if state.device.type == "cpu":
        return numba_delta_rule.delta_rule_step(q, k, v, g, beta, state, rows)
    return delta_rule_step_torch(q, k, v, g, beta, state, rows)


def delta_rule_step_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """One token for each of B sequences: recurrent_delta_rule with T = 1 from state[rows],
    whose final states replace state[rows]. q, k [B, Hk, dk] (value head h reads key head
    h // (H / Hk)), v [B, H, dv], g, beta [B, H], all float32, q already scaled; state
    [R, H, dk, dv] float32, rows [B] int64 (distinct). Returns o [B, H, dv] float32."""
    B, H, dv = v.shape
    group = H // k.shape[1]
    q, k = (x.repeat_interleave(group, dim=1).reshape(B * H, 1, -1) for x in (q, k))
    S = state[rows].view(B * H, -1, dv)  # [B H, dk, dv], the rows gathered once
    S.mul_(g.reshape(B * H, 1, 1).exp())
    predicted = torch.bmm(k, S)  # [B H, 1, dv]
    update = (v.reshape(B * H, 1, dv) - predicted) * beta.reshape(B * H, 1, 1)
    S.baddbmm_(k.transpose(1, 2), update)  # S + k u^T
    out = torch.bmm(q, S).view(B, H, dv)
    state.index_copy_(0, rows, S.view(B, H, -1, dv))
    return out


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent_delta_rule's result, chunk by chunk; same arguments and contract."""
    B, H, T, dk = k.shape
    S = k.new_zeros(B, H, dk, v.shape[-1]) if state is None else state.float()
    out = torch.empty_like(v)
    for start in range(0, T, chunk_tokens):
        span = slice(start, min(start + chunk_tokens, T))
        parts = (x[:, :, span] for x in (q, k, v, g, beta))
        out[:, :, span], S = _chunk(*parts, S)
    return out, S


def _chunk(q, k, v, g, beta, S):
    """One chunk of C tokens from state S: (o [B, H, C, dv], the state after it).

    With gamma = cumsum(g), D[i, j] = exp(gamma_i - gamma_j) for j <= i (0 above), the
    writes u of the chunk satisfy (I + L) u = beta (v - exp(gamma) K S) with
    L[i, j] = beta_i D[i, j] k_i.k_j for j < i; then o = exp(gamma) Q S + (Q K^T * D) u
    and S' = exp(gamma_C) S + (exp(gamma_C - gamma) K)^T u."""
    C = k.shape[2]
    gamma = g.cumsum(dim=-1)  # [B, H, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf"))
    decay = decay.exp()  # [B, H, C, C]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # diagonal ignored: unit triangular
    rhs = v * beta[..., None] - (k_beta * gamma.exp()[..., None]) @ S  # [B, H, C, dv]
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # [B, H, C, C]
    out = (q * gamma.exp()[..., None]) @ S + scores @ u
    to_end = (gamma[..., -1:] - gamma).exp()  # [B, H, C]
    S = S * gamma[..., -1].exp()[..., None, None] + (k * to_end[..., None]).transpose(-1, -2) @ u
    return out, S
