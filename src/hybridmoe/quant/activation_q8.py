"""Activation quantisation: the `q8` contract of a projection whose weights are 32-integer
blocks (q8_0, q4_0: WeightFormat.has_int8_blocks) or integer super-blocks (q2_k ... q6_k:
has_superblock_ints), as llama.cpp computes its quantised matmuls; the torch reference that
every path (the numba CPU kernel, `bank_moe`, the accelerator's `gathered_moe`, prefill)
reproduces bit for bit, so every decode target still gives the same tokens.

For one output y = Σ w_k x_k of a weight row w and an activation row x [K] (float32; a bf16
activation widened exactly), K = 32 nb:
1. x is quantised per 32-block as ggml's quantize_row_q8_0_ref, with the scale kept in float32
   (ggml rounds the weights' scale to fp16; an activation's is never stored): d_x = max|x| /
   127, q_x = roundf(x * (1 / d_x)) (halves away from zero; 0 when d_x is 0), |q_x| <= 127.
   The activations must be finite.
2. block b's integer dot s_b = Σ_i v_i q_i of the weights' integers v (weight = d_w v) and q_x
   is exact (|s_b| <= 32 * 127 * 127 < 2^24, so exact in int32 and in float32 alike);
3. p_b = float32(s_b) * (d_w * d_x), each product rounded to float32 (no fused multiply-add);
4. the p_b are summed in float32 in LANES = 8 lanes: lane j = (((0 + p_j) + p_{j+8}) +
   p_{j+16}) + ..., then y = ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
Steps 2-4 fix the order of every float operation, so any instruction set (integer dot products
of any width) gives the same y.

A k-quant row (quant/_kquants.SuperBlockInts: weight i of sub-block j = d sc_j (u_i - o) -
dmin m_j) takes the same steps per 256-weight super-block instead of per 32-block, as ggml's
q8_K does, so that a super-block's sub-blocks add up in integers:
1. x is quantised per 256-block by step 1's formula (d_x = max|x| / 127 over the 256);
2. with s_j = Σ_{i in j} u_i q_i and B_j = Σ_{i in j} q_i over sub-block j, the integers
   S = Σ_j sc_j (s_j - o B_j) and, for a format with minimums, M = Σ_j m_j B_j, exact in int32
   (|S| < 256 * 63 * 127 * 128 < 2^31);
3. p_b = float32(S) * (d * d_x) - float32(M) * (dmin * d_x) (each product rounded to float32,
   then the difference; without minimums p_b = float32(S) * (d * d_x));
4. as above, over the super-blocks.
"""

from __future__ import annotations

import torch

from hybridmoe.quant.formats import KERNEL_BLOCK, WeightFormat
from hybridmoe.quant.q8_0 import q8_0_blocks_f32

# OffloadConfig.activation_quant's choices; a bank holds "none" or "q8" (resolve() picks)
ACTIVATION_QUANTS = ("auto", "none", "q8")
BANK_ACTIVATION_QUANTS = ("none", "q8")
LANES = 8  # float32 lanes the block products are summed in (step 4)
SUPER_BLOCK = 256  # the activation block of a k-quant row


def quantize_activations(
    x: torch.Tensor, block: int = KERNEL_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of `block`, 32 or SUPER_BLOCK; float32, or a float dtype
    widened to it exactly) -> (q int8 [..., K / block, block], d float32 [..., K / block]),
    step 1 of the contract."""
    if x.shape[-1] % block:
        raise ValueError(f"activation_quant q8: rows of {x.shape[-1]} are not {block}-blocks")
    blocks = x.to(torch.float32).reshape(-1, block)  # [B, block]
    d, q = q8_0_blocks_f32(blocks)
    return q.reshape(*x.shape[:-1], -1, block), d.reshape(*x.shape[:-1], -1)


def q8_linear(x: torch.Tensor, stored: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """x [n, K] float, stored weight rows [R, row_bytes] in `fmt` -> float32 [n, R], each
    output by the contract (the module docstring)."""
    if fmt.has_superblock_ints:
        return _superblock_dots(x, fmt.superblock_ints(stored), "nsjk,rsjk->nrsj", batched=False)
    qx, dx = quantize_activations(x)  # [n, nb, 32], [n, nb]
    qw, dw = fmt.int8_blocks(stored)  # [R, nb, 32], [R, nb]
    sums = torch.einsum("nbi,rbi->nrb", qx.float(), qw.float())  # [n, R, nb]; exact integers
    return _lane_sum(sums * (dw[None] * dx[:, None]))


def q8_bmm(x: torch.Tensor, stored: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """x [c, K] float, stored [c, R, row_bytes] (each route's own rows) -> float32 [c, R]:
    q8_linear route by route, batched."""
    if fmt.has_superblock_ints:
        return _superblock_dots(x, fmt.superblock_ints(stored), "csjk,crsjk->crsj", batched=True)
    qx, dx = quantize_activations(x)  # [c, nb, 32], [c, nb]
    qw, dw = fmt.int8_blocks(stored)  # [c, R, nb, 32], [c, R, nb]
    sums = torch.einsum("cbi,crbi->crb", qx.float(), qw.float())  # [c, R, nb]; exact
    return _lane_sum(sums * (dw * dx[:, None]))


def _superblock_dots(x: torch.Tensor, ints, pattern: str, batched: bool) -> torch.Tensor:
    """x [n, K] float and a k-quant's SuperBlockInts (rows [R, nsb, ...], or [n, R, nsb, ...]
    when `batched`) -> float32 [n, R]: the contract's super-block steps, with the sums s_j
    of `pattern` (einsum over the sub-block's weights k: exact in float32, |s_j| <= 32 * 63 *
    127 < 2^24) and everything after them in int32."""
    qx, dx = quantize_activations(x, SUPER_BLOCK)  # [n, nsb, 256], [n, nsb]
    subs = ints.scales.shape[-1]
    q = qx.reshape(*qx.shape[:-1], subs, -1)  # [n, nsb, subs, 256 / subs]
    u = ints.u.reshape(*ints.u.shape[:-1], subs, -1)
    sums = torch.einsum(pattern, q.float(), u.float()).to(torch.int32)  # [n, R, nsb, subs]
    b = q.sum(-1, dtype=torch.int32)[:, None]  # [n, 1, nsb, subs]
    lead = (lambda t: t) if batched else (lambda t: t[None])  # the rows' [n] axis
    s = ((sums - ints.offset * b) * lead(ints.scales)).sum(-1, dtype=torch.int32)  # [n, R, nsb]
    dx = dx[:, None]  # [n, 1, nsb]
    products = s.float() * (lead(ints.d) * dx)
    if ints.mins is not None:
        m = (b * lead(ints.mins)).sum(-1, dtype=torch.int32)
        products = products - m.float() * (lead(ints.dmin) * dx)
    return _lane_sum(products)


def _lane_sum(products: torch.Tensor) -> torch.Tensor:
    """products [..., nb] float32 -> [...]: step 4, LANES lanes then the fixed tree."""
    nb = products.shape[-1]
    groups = -(-nb // LANES)
    padded = torch.zeros(*products.shape[:-1], groups * LANES, dtype=torch.float32)
    padded = padded.to(products.device)
    padded[..., :nb] = products  # the padding adds +0.0 to a lane: no change
    lanes = torch.zeros(*products.shape[:-1], LANES, dtype=torch.float32, device=products.device)
    for g in range(groups):
        lanes = lanes + padded[..., g * LANES : (g + 1) * LANES]
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes[..., 0]


def resolve(activation_quant: str, formats: tuple[WeightFormat, WeightFormat]) -> str:
    """The bank's activation_quant for OffloadConfig's: "auto" is "q8" when gate/up's and
    down's formats (`formats`) both have integer dot products (q8_0, q4_0, q2_k ... q6_k:
    llama.cpp's arithmetic for them), else "none" (floats, q4_1, q5_0, q5_1, mxfp4, or a
    layer mixing the two kinds); "none" and "q8" stay (check_formats judges them)."""
    if activation_quant != "auto":
        return activation_quant
    return "q8" if all(fmt.has_integer_dots for fmt in formats) else "none"


def check_formats(activation_quant: str, formats: tuple[WeightFormat, WeightFormat]) -> None:
    """ValueError unless `activation_quant` is a bank's choice ("none" or "q8": "auto" is
    resolved before) and, for q8, gate/up's and down's formats (`formats`) both have integer
    dot products (has_integer_dots) or neither (then q8 changes nothing)."""
    if activation_quant not in BANK_ACTIVATION_QUANTS:
        raise ValueError(
            f"a bank's activation_quant must be one of {', '.join(BANK_ACTIVATION_QUANTS)}, "
            f"got {activation_quant!r}"
        )
    kinds = {fmt.has_integer_dots for fmt in formats}
    if activation_quant == "q8" and len(kinds) > 1:
        names = "/".join(fmt.name for fmt in formats)
        raise ValueError(
            f"activation_quant q8: experts in {names} mix formats with integer dot products "
            "(q8_0, q4_0, q2_k ... q6_k) and others; it needs all of gate/up and down in "
            "one kind"
        )


def uses_q8(activation_quant: str, fmt: WeightFormat) -> bool:
    """Whether a projection in `fmt` computes by the q8 contract under `activation_quant`."""
    return activation_quant == "q8" and fmt.has_integer_dots
