"""The attention block (kernels/attention_block.py: a host decode step's q/k/v projection, q/k
norms and rotary, KV write and attention, o projection in one numba call; in a decoder layer
also the input and post-attention RMSNorms with their residual adds) against the same parts
called one by one (HYBRIDMOE_ATTENTION_BLOCK=0): every decode step's logits equal bit for bit,
in bfloat16 and float32, one sequence and three batched, the block's kernels serial and
parallel, with and without the norms (with them, the MoE layer's routing in the same call);
the block really runs (counted), a router's tie goes back to the router, and a block that
computes otherwise fails the comparison."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.kernels import attention_block, numba_attention, numba_dense
from hybridmoe.models.transformer import DecoderLayer
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.moe.routing import SoftmaxTopKRouter

PROMPTS = [[5, 17, 300, 42, 7, 8, 9], [9, 1000], [3, 4, 5, 6]]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def decode_logits(
    directory: Path, dtype: str, prompts: list[list[int]], kernel: str = "on", prepare=None
) -> list[torch.Tensor]:
    """The logits of every decode step of a greedy generation (the model's forward records
    them), on the cpu target with 2 threads; prepare(model) first if given."""
    offload = OffloadConfig(decode_target="cpu", cpu_threads=2)
    config = EngineConfig(dtype=dtype, threads=2, attention_kernel=kernel, offload=offload)
    logits = []
    with Engine.from_pretrained(directory, config) as engine:
        if prepare is not None:
            prepare(engine.model)
        forward = engine.model.forward

        def recording(ids, batch, *args, **kwargs):
            out = forward(ids, batch, *args, **kwargs)
            if batch.is_decode:
                logits.append(out.clone())
            return out

        engine.model.forward = recording
        engine.generate_ids(prompts, GREEDY)
    return logits


def block_calls(monkeypatch: pytest.MonkeyPatch, routed: list | None = None) -> list[int]:
    """The rows of every block call; into `routed`, of each call with the norms, whether an
    MoE layer's router asked for its step in the block and what the block gave: "routes"
    (ids and weights), "logits" (left to torch: a tie) or None (the router's step)."""
    calls, run = [], attention_block._run

    def counting(qkv, o, q_norm, k_norm, eps, x, *args):
        calls.append(x.shape[0])
        out = run(qkv, o, q_norm, k_norm, eps, x, *args)
        if routed is not None and isinstance(out, tuple):
            kind = {tuple: "routes", torch.Tensor: "logits"}.get(type(out[2]))
            routed.append((args[-1] is not None, kind))
        return out

    monkeypatch.setattr(attention_block, "_run", counting)
    return calls


def assert_same_logits(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected) > 0
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"decode step {step}: {(a - b).abs().max().item()}"


@pytest.mark.parametrize("norms", [True, False], ids=["with-norms", "attention-only"])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_block_gives_the_parts_bits(
    demo_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    rows: int,
    parallel: bool,
    norms: bool,
) -> None:
    if not norms:  # the decoder layer's norms stay its own: the block is the attention alone
        monkeypatch.setattr(DecoderLayer, "_residual_block", lambda *args: None)
    if parallel:  # every weight and step over the parallel threshold: the parallel kernels
        monkeypatch.setattr(numba_dense, "MIN_PARALLEL_BYTES", 0)
        monkeypatch.setattr(numba_attention, "MIN_PARALLEL_BYTES", 0)
    prompts = PROMPTS[:rows]
    monkeypatch.setenv("HYBRIDMOE_ATTENTION_BLOCK", "0")
    parts = decode_logits(demo_checkpoint, dtype, prompts)
    monkeypatch.delenv("HYBRIDMOE_ATTENTION_BLOCK")
    routed = []
    calls = block_calls(monkeypatch, routed)
    assert_same_logits(decode_logits(demo_checkpoint, dtype, prompts), parts)
    assert calls and set(calls) == {rows}
    if norms:  # every MoE layer's routing in the block (the demo's first layer is dense)
        assert len(routed) == len(calls) and any(kind == "routes" for _, kind in routed)
        assert all((kind is not None) == asked for asked, kind in routed)
    else:
        assert routed == []


def test_a_tie_in_the_router_goes_to_torch(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gate of zeros: every logit equal, the block leaves the routing of its logits to torch
    (torch's top-k order among ties), and the logits are still the parts'."""

    def zero_gates(model) -> None:
        for layer in model.moe_layers:
            layer.router.gate.weight.zero_()

    monkeypatch.setenv("HYBRIDMOE_ATTENTION_BLOCK", "0")
    parts = decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:1], prepare=zero_gates)
    monkeypatch.delenv("HYBRIDMOE_ATTENTION_BLOCK")
    routed = []
    calls = block_calls(monkeypatch, routed)
    got = decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:1], prepare=zero_gates)
    assert_same_logits(got, parts)
    assert calls and any(asked for asked, _ in routed)
    assert all((kind == "logits") == asked for asked, kind in routed)


def test_a_block_routing_otherwise_fails_the_comparison(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The routing's comparison can fail: a block that renormalises where the router does
    not (or the other way round)."""
    monkeypatch.setenv("HYBRIDMOE_ATTENTION_BLOCK", "0")
    parts = decode_logits(demo_checkpoint, "float32", PROMPTS[:1])
    monkeypatch.delenv("HYBRIDMOE_ATTENTION_BLOCK")
    block_route = SoftmaxTopKRouter.block_route

    def flipped(self, dtype):
        gate, k, renorm, weights_dtype = block_route(self, dtype)
        return gate, k, not renorm, weights_dtype

    monkeypatch.setattr(SoftmaxTopKRouter, "block_route", flipped)
    with pytest.raises(AssertionError, match="decode step 0"):
        assert_same_logits(decode_logits(demo_checkpoint, "float32", PROMPTS[:1]), parts)


def test_the_default_takes_the_block_where_the_kernel_runs(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, attention_kernel_calls: list[int]
) -> None:
    """No flags (attention_kernel auto): the block runs exactly where the attention kernel
    does (bfloat16 on a machine whose SDPA it reproduces), with the parts' bits."""
    monkeypatch.setenv("HYBRIDMOE_ATTENTION_BLOCK", "0")
    parts = decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:2], kernel="auto")
    kernel_ran = bool(attention_kernel_calls)
    monkeypatch.delenv("HYBRIDMOE_ATTENTION_BLOCK")
    calls = block_calls(monkeypatch)
    assert_same_logits(decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:2], "auto"), parts)
    assert bool(calls) == kernel_ran


def test_off_and_sdpa_steps_skip_the_block(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = block_calls(monkeypatch)
    decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:1], kernel="off")
    decode_logits(demo_checkpoint, "float32", PROMPTS[:1], kernel="auto")  # SDPA in float32
    assert calls == []


def test_a_block_computing_otherwise_fails_the_comparison(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison above can fail: a block whose norm takes another epsilon."""
    monkeypatch.setenv("HYBRIDMOE_ATTENTION_BLOCK", "0")
    parts = decode_logits(demo_checkpoint, "float32", PROMPTS[:1])
    monkeypatch.delenv("HYBRIDMOE_ATTENTION_BLOCK")
    run = attention_block._run

    def other_eps(qkv, o, q_norm, k_norm, eps, *args):
        return run(qkv, o, q_norm, k_norm, eps * 4 + 1e-3, *args)

    monkeypatch.setattr(attention_block, "_run", other_eps)
    with pytest.raises(AssertionError, match="decode step 0"):
        assert_same_logits(decode_logits(demo_checkpoint, "float32", PROMPTS[:1]), parts)
