"""Gated DeltaNet at module level, against `transformers`' torch implementation (float32):
the delta rule's chunked (prefill) and recurrent (decode) forms against each other and against
transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule, across chunk
boundaries; the decode step (numba kernel and torch form, the state in place in the cache's
rows) against the recurrent form; the whole layer in both checkpoint layouts (Qwen3-Next's fused
qkvz/ba, Qwen3.5's separate projections) for a prefill and then decode steps through a cache,
several rows at once at different positions."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.kernels import numba_delta_rule
from hybridmoe.layers.attention import create_attention
from hybridmoe.layers.batch import ForwardBatch
from hybridmoe.layers.delta_rule import (
    chunked_delta_rule,
    delta_rule_step,
    delta_rule_step_torch,
    l2_normalize,
    recurrent_delta_rule,
)
from hybridmoe.loader.weights import WeightSource
from hybridmoe.models.registry import MODEL_REGISTRY

ATOL = RTOL = 1e-5  # fp32; summation order only


def _inputs(B: int, T: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, hk, dk, generator=gen), torch.randn(B, T, hk, dk, generator=gen)
    v = torch.randn(B, T, hv, dv, generator=gen)
    g = -0.3 * torch.rand(B, T, hv, generator=gen)  # slow decay: the state carries far
    beta = torch.rand(B, T, hv, generator=gen)
    state = torch.randn(B, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _ours(q, k, v, g, beta, state, form):
    group = v.shape[2] // k.shape[2]
    heads = [x.transpose(1, 2) for x in (q, k, v, g, beta)]  # [B, H, T, ...]
    q, k = (l2_normalize(x.repeat_interleave(group, dim=1)) for x in heads[:2])
    q = q * q.shape[-1] ** -0.5
    out, final = form(q, k, heads[2], heads[3], heads[4], state)
    return out.transpose(1, 2), final  # [B, T, H, dv]


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_delta_rule_forms_match_transformers(T: int, with_state: bool) -> None:
    q, k, v, g, beta, state = _inputs(2, T, hk=2, hv=4, dk=8, dv=12)
    state = state if with_state else None
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_chunk = hf_next.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)
    ref_step = hf_next.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)
    chunked = _ours(q, k, v, g, beta, state, chunked_delta_rule)
    stepped = _ours(q, k, v, g, beta, state, recurrent_delta_rule)
    for ours, ref in ((chunked, ref_chunk), (stepped, ref_step), (chunked, stepped)):
        torch.testing.assert_close(ours[0], ref[0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(ours[1], ref[1], atol=ATOL, rtol=RTOL)


def test_chunked_form_does_not_modify_the_state() -> None:
    q, k, v, g, beta, state = _inputs(1, 70, hk=1, hv=2, dk=4, dv=4)
    before = state.clone()
    _ours(q, k, v, g, beta, state, chunked_delta_rule)
    _ours(q, k, v, g, beta, state, recurrent_delta_rule)
    assert torch.equal(state, before)


# (architecture, transformers config class, its GatedDeltaNet module, our kind)
LAYOUTS = {
    "qkvz": ("Qwen3NextForCausalLM", "Qwen3NextConfig", hf_next.Qwen3NextGatedDeltaNet),
    "separate": (
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        hf_qwen3_5.Qwen3_5MoeGatedDeltaNet,
    ),
}
SIZES = dict(
    vocab_size=32, hidden_size=24, num_hidden_layers=2, num_attention_heads=2, head_dim=8,
    num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
    shared_expert_intermediate_size=8, linear_conv_kernel_dim=4, linear_key_head_dim=8,
    linear_value_head_dim=6, linear_num_key_heads=2, linear_num_value_heads=6,
)  # fmt: skip


def _layers(layout: str, tmp_path):
    """(transformers' layer 0, ours over the same weights, our ModelConfig, the HF config)."""
    architecture, config_name, module = LAYOUTS[layout]
    hf_config = getattr(transformers, config_name)(**SIZES)
    torch.manual_seed(3)
    hf_layer = module(hf_config, 0).eval()
    with torch.no_grad():
        for param in hf_layer.parameters():
            param.copy_(torch.randn(param.shape) / max(1, param.shape[-1]) ** 0.5)
        hf_layer.A_log.copy_(torch.rand(hf_layer.A_log.shape).mul(0.5).add(0.02).log())
    path = tmp_path / "layer.safetensors"
    save_file({f"l.{n}": p.detach().contiguous() for n, p in hf_layer.state_dict().items()}, path)
    family = MODEL_REGISTRY[architecture]
    cfg = family.config_from({**hf_config.to_dict(), "architectures": [architecture]})
    source = WeightSource([path], torch.float32)
    ours = create_attention(family.linear_attention, cfg, 0, source, "l")
    assert not source.unread_names()
    return hf_layer, ours, cfg, hf_config


def _batch(cfg, positions: torch.Tensor, rows: list[int], kv, is_decode: bool) -> ForwardBatch:
    B, T = positions.shape
    empty = torch.zeros(B, T, 0)
    return ForwardBatch(
        positions, rows, torch.tensor(rows), int(positions.max()) + 1, {None: (None, False)},
        empty, empty, kv, is_decode,
    )  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_prefill_and_decode_match_transformers(layout: str, tmp_path) -> None:
    hf_layer, ours, cfg, hf_config = _layers(layout, tmp_path)
    lengths, steps = [65, 3], 5  # two sequences in rows 2 and 0, at different positions
    rows = [2, 0]
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randn(1, n, cfg.hidden_size, generator=gen) for n in lengths]
    tokens = torch.randn(steps, len(rows), 1, cfg.hidden_size, generator=gen)
    cache = KVCache(cfg, 3, 80, torch.float32)
    with torch.no_grad():
        hf_caches = [transformers.DynamicCache(config=hf_config) for _ in rows]
        for prompt, row, hf_cache in zip(prompts, rows, hf_caches, strict=True):
            expected = hf_layer(prompt, cache=hf_cache)
            positions = torch.arange(prompt.shape[1])[None]
            got = ours(prompt, _batch(cfg, positions, [row], cache, is_decode=False))
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
        for step in range(steps):
            expected = torch.cat(
                [hf_layer(tokens[step, i : i + 1], cache=c) for i, c in enumerate(hf_caches)]
            )
            positions = torch.tensor([[n + step] for n in lengths])
            got = ours(tokens[step], _batch(cfg, positions, rows, cache, is_decode=True))
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
        _, delta = cache.recurrent_state(0)
        assert torch.equal(delta[1], torch.zeros_like(delta[1]))  # row 1 was never used


def test_layer_without_cache_is_a_fresh_prefill(tmp_path) -> None:
    hf_layer, ours, cfg, _ = _layers("qkvz", tmp_path)
    x = torch.randn(2, 9, cfg.hidden_size)
    with torch.no_grad():
        expected = hf_layer(x)
    got = ours(x, _batch(cfg, torch.arange(9).expand(2, 9), [0, 1], None, is_decode=False))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def _step_inputs(B: int, rows_total: int, hk: int, hv: int, dk: int, dv: int, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, hk, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(B, hk, dk, generator=gen))
    v = torch.randn(B, hv, dv, generator=gen)
    g, beta = -0.3 * torch.rand(B, hv, generator=gen), torch.rand(B, hv, generator=gen)
    return q, k, v, g, beta, torch.randn(rows_total, hv, dk, dv, generator=gen)


@pytest.mark.parametrize("form", [delta_rule_step, delta_rule_step_torch])
@pytest.mark.parametrize("rows", [[0], [3, 0, 4], [0, 1, 2, 3, 4]])
def test_decode_step_updates_the_rows_in_place_as_the_reference(form, rows) -> None:
    """delta_rule_step (the numba kernel on the CPU) and its torch form against
    recurrent_delta_rule for one token from each row's state: its output, the rows' final
    states in place, every other row untouched."""
    q, k, v, g, beta, state = _step_inputs(len(rows), 5, hk=2, hv=4, dk=8, dv=12)
    index = torch.tensor(rows)
    group = v.shape[1] // k.shape[1]
    as_seq = [x.repeat_interleave(group, dim=1)[:, :, None] for x in (q, k)]  # [B, H, 1, dk]
    ref_out, ref_state = recurrent_delta_rule(
        *as_seq, v[:, :, None], g[..., None], beta[..., None], state[index]
    )
    ours = state.clone()
    out = form(q, k, v, g, beta, ours, index)
    torch.testing.assert_close(out, ref_out[:, :, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours[index], ref_state, atol=1e-6, rtol=1e-6)
    others = [r for r in range(5) if r not in rows]
    assert torch.equal(ours[others], state[others])


def test_decode_step_kernel_refuses_a_state_it_cannot_update_in_place() -> None:
    q, k, v, g, beta, state = _step_inputs(2, 3, hk=1, hv=2, dk=4, dv=4)
    rows = torch.tensor([0, 2])
    with pytest.raises(ValueError, match="contiguous float32 host memory"):
        numba_delta_rule.delta_rule_step(q, k, v, g, beta, state.transpose(2, 3), rows)
    with pytest.raises(ValueError, match="contiguous float32 host memory"):
        numba_delta_rule.delta_rule_step(q, k, v, g, beta, state.double(), rows)
    with pytest.raises(ValueError, match="do not fit"):
        numba_delta_rule.delta_rule_step(q, k, v, g, beta, state[:, :1].contiguous(), rows)


@pytest.mark.parametrize("dims", [(8, 16, 64, 64), (2, 4, 128, 128), (1, 1, 256, 64)])
def test_decode_step_kernel_is_the_reference_bit_for_bit(dims) -> None:
    """Where each head's dv is whole blocks of torch's 4-vector column sums (64 floats on
    AVX-512, 32 on AVX2; Qwen3-Next and Qwen3.5 have dv = 128) the kernel's cascade order is
    torch's: outputs and states identical, so bf16 rounds them as transformers does."""
    hk, hv, dk, dv = dims
    q, k, v, g, beta, state = _step_inputs(3, 4, hk, hv, dk, dv)
    index = torch.tensor([2, 0, 3])
    as_seq = [x.repeat_interleave(hv // hk, dim=1)[:, :, None] for x in (q, k)]
    ref_out, ref_state = recurrent_delta_rule(
        *as_seq, v[:, :, None], g[..., None], beta[..., None], state[index]
    )
    out = numba_delta_rule.delta_rule_step(q, k, v, g, beta, state, index)
    assert torch.equal(out, ref_out[:, :, 0])
    assert torch.equal(state[index], ref_state)
