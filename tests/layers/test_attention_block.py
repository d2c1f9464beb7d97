"""The attention block (kernels/attention_block.py: a host decode step's q/k/v projection, q/k
norms and rotary, KV write and attention, o projection in one numba call; in a decoder layer
also the input and post-attention RMSNorms with their residual adds) against the same parts
called one by one (HYBRIDMOE_ATTENTION_BLOCK=0): every decode step's logits equal bit for bit,
in bfloat16 and float32, one sequence and three batched, the block's kernels serial and
parallel, with and without the norms (with them, the MoE layer's routing and its routed
experts in the same call, float and quantised banks, float32 and q8 activations); the block
really runs (counted), a router's tie goes back to the router, the executor counts the
block's routes, and a block that computes otherwise fails the comparison."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from gguf_checkpoints import random_dense_encoder, write_gguf
from hf_checkpoints import PROMPT_IDS, write_custom_checkpoint
from hybridmoe import env
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.kernels import attention_block, numba_attention, numba_dense
from hybridmoe.models import transformer
from hybridmoe.models.transformer import DecoderLayer
from hybridmoe.moe.backends import CpuExperts
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.moe.routing import SoftmaxTopKRouter
from hybridmoe.quant.formats import weight_format
from random_weights import random_stored

PROMPTS = [[5, 17, 300, 42, 7, 8, 9], [9, 1000], [3, 4, 5, 6]]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def decode_logits(
    directory: Path,
    dtype: str,
    prompts: list[list[int]],
    kernel: str = "on",
    prepare=None,
    routes: list | None = None,
    **offload_args,
) -> list[torch.Tensor]:
    """The logits of every decode step of a greedy generation (the model's forward records
    them), on the cpu target with 2 threads (OffloadConfig's `offload_args` otherwise);
    prepare(model) first if given; into `routes` the CPU executor's count of routes."""
    offload = OffloadConfig(**{"decode_target": "cpu", "cpu_threads": 2, **offload_args})
    config = EngineConfig(dtype=dtype, threads=2, attention_kernel=kernel, offload=offload)
    logits = []
    with Engine.from_pretrained(directory, config) as engine:
        if prepare is not None:
            prepare(engine.model)
        record_decode_logits(engine.model, logits)
        engine.generate_ids(prompts, GREEDY)
        if routes is not None:
            stats = engine.moe_runtime.cpu_executor.stats.values()
            routes.append(sum(layer.routes for layer in stats))
    return logits


@contextmanager
def recording_engine(directory: Path, dtype: str) -> Iterator[tuple[Engine, list[torch.Tensor]]]:
    """A `cpu`-target engine (2 threads, the attention kernel on) and the list its model
    appends each decode step's logits to."""
    offload = OffloadConfig(decode_target="cpu", cpu_threads=2)
    config = EngineConfig(dtype=dtype, threads=2, attention_kernel="on", offload=offload)
    with Engine.from_pretrained(directory, config) as engine:
        logits: list[torch.Tensor] = []
        record_decode_logits(engine.model, logits)
        yield engine, logits


def record_decode_logits(model, logits: list[torch.Tensor]) -> None:
    """From now on model.forward appends each decode step's logits (a copy) to `logits`."""
    forward = model.forward

    def recording(ids, batch, *args, **kwargs):
        out = forward(ids, batch, *args, **kwargs)
        if batch.is_decode:
            logits.append(out.clone())
        return out

    model.forward = recording


def block_calls(monkeypatch: pytest.MonkeyPatch, routed: list | None = None) -> list[int]:
    """The rows of every block call; into `routed`, of each call with the norms, whether an
    MoE layer's router asked for its step in the block and what the block gave: "routes"
    (ids and weights), "experts" (those and the experts' partial), "logits" (left to torch: a
    tie) or None (the router's step)."""
    calls, run = [], attention_block._run

    def counting(qkv, o, q_norm, k_norm, eps, x, *args, **kwargs):
        calls.append(x.shape[0])
        out = run(qkv, o, q_norm, k_norm, eps, x, *args, **kwargs)
        if routed is not None and isinstance(out, tuple):
            kind = {tuple: "routes", torch.Tensor: "logits"}.get(type(out[2]))
            if out[3] is not None:
                kind = "experts"
            routed.append((args[-2] is not None, kind))
        return out

    monkeypatch.setattr(attention_block, "_run", counting)
    return calls


def blocks(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """The blocks on (the default) or off (HYBRIDMOE_ATTENTION_BLOCK=0: the parts one by
    one) from now on in this test."""
    if on:
        monkeypatch.delenv("HYBRIDMOE_ATTENTION_BLOCK")
    else:
        monkeypatch.setenv("HYBRIDMOE_ATTENTION_BLOCK", "0")
    env.reread_switches()


def head_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Of every decode step's end (MoeCausalLM.forward's decode_head): whether the head block
    computed the logits (else the norm and head ran as parts)."""
    calls, decode_head = [], transformer.decode_head

    def counting(*args, **kwargs):
        out = decode_head(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(transformer, "decode_head", counting)
    return calls


def assert_same_logits(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected) > 0
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"decode step {step}: {(a - b).abs().max().item()}"


@pytest.mark.parametrize("norms", [True, False], ids=["with-norms", "attention-only"])
@pytest.mark.parametrize("parallel", ["serial", "dense", "all"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_block_gives_the_parts_bits(
    demo_checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    rows: int,
    parallel: str,
    norms: bool,
) -> None:
    """`parallel`: every weight and step under the parallel thresholds (serial kernels), every
    weight over (dense: the block's attention then parallel where it has 2 (sequence, kv head)
    items a thread, block_attention_threads; the parts' stays serial), or every weight and
    step over (all)."""
    if not norms:  # the decoder layer's norms stay its own: the block is the attention alone
        monkeypatch.setattr(DecoderLayer, "_residual_block", lambda *args: None)
    if parallel != "serial":
        monkeypatch.setattr(numba_dense, "MIN_PARALLEL_BYTES", 0)
    if parallel == "all":
        monkeypatch.setattr(numba_attention, "MIN_PARALLEL_BYTES", 0)
    prompts = PROMPTS[:rows]
    blocks(monkeypatch, False)
    off = head_calls(monkeypatch)
    parts = decode_logits(demo_checkpoint, dtype, prompts)
    assert off and not any(off)  # the switch, read again, turned the blocks off
    blocks(monkeypatch, True)
    routed = []
    calls, heads = block_calls(monkeypatch, routed), head_calls(monkeypatch)
    assert_same_logits(decode_logits(demo_checkpoint, dtype, prompts), parts)
    assert calls and set(calls) == {rows}
    assert heads and all(heads)  # every decode step's norm and head in the head block
    if norms:  # every MoE layer's routing and experts in the block (the demo's first layer
        # is dense)
        assert len(routed) == len(calls) and any(kind == "experts" for _, kind in routed)
        assert all((kind is not None) == asked for asked, kind in routed)
        assert "routes" not in {kind for _, kind in routed}  # routed: the experts computed
    else:
        assert routed == []


# a Qwen3-MoE of k-quant widths (one super-block a row), its experts as a Q4_K_M file mixes
# them: Q4_K gate/up, Q6_K down
KQUANT_QWEN3 = dict(
    hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
    intermediate_size=128, norm_topk_prob=True,
)  # fmt: skip
KQUANT_TYPES = {"gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K"}


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("block-kquants")
    hf_dir = write_custom_checkpoint("qwen3_moe", KQUANT_QWEN3, root / "hf", seed=0)

    def encode(layer: str, proj: str, stacked: np.ndarray) -> tuple[np.ndarray, QType]:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{layer}.{proj}".encode()))
        fmt = weight_format(KQUANT_TYPES[proj].lower())
        return random_stored(fmt, stacked.shape, gen, 0.08).numpy(), QType[KQUANT_TYPES[proj]]

    return write_gguf(hf_dir, root / "model.gguf", experts=encode)


# attention and head in a Q4_K_M file's types: q, k, o Q4_K, v Q6_K (apart from q and k in
# the block), the head Q6_K
DENSE_TYPES = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K",
               "lm_head": "Q6_K"}  # fmt: skip


@pytest.fixture(scope="module")
def dense_kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("block-dense-kquants")
    hf_dir = write_custom_checkpoint(
        "qwen3_moe", {**KQUANT_QWEN3, "tie_word_embeddings": False}, root / "hf", seed=0
    )
    return write_gguf(hf_dir, root / "model.gguf", dense=random_dense_encoder(DENSE_TYPES))


@pytest.mark.parametrize("activation_quant", ["none", "q8"])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dense_projections_in_a_files_types_give_the_parts_bits(
    dense_kquant_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    rows: int,
    parallel: bool,
    activation_quant: str,
) -> None:
    """The file's Q4_K / Q6_K projections (float or q8 activations), v's a second weight in
    the block, its output the values the attention reads (rows > 1: no copy)."""
    if parallel:
        monkeypatch.setattr(numba_dense, "MIN_PARALLEL_BYTES", 0)
        monkeypatch.setattr(numba_attention, "MIN_PARALLEL_BYTES", 0)
    prompts = [[5, 17, 30, 42, 7, 8, 9], [9, 10], [3, 4, 5, 6]][:rows]  # in the vocabulary
    quant = dict(activation_quant=activation_quant)
    blocks(monkeypatch, False)
    parts = decode_logits(dense_kquant_gguf, dtype, prompts, **quant)
    blocks(monkeypatch, True)
    calls, heads = block_calls(monkeypatch), head_calls(monkeypatch)
    assert_same_logits(decode_logits(dense_kquant_gguf, dtype, prompts, **quant), parts)
    assert calls and set(calls) == {rows}
    assert heads and all(heads)  # the Q6_K head (q8 activations: its q8 kernel) in the block


@pytest.mark.parametrize(
    "model, formats",
    [
        ("demo", dict(expert_format="q8_0", activation_quant="q8")),
        ("kquants", dict(activation_quant="none")),
        ("kquants", dict(activation_quant="q8")),
    ],
    ids=["q8_0-q8", "q4_k_m-none", "q4_k_m-q8"],
)
def test_quantised_experts_in_the_block_give_the_parts_bits(
    demo_checkpoint: Path,
    kquant_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    formats: dict,
) -> None:
    """A quantised bank's experts computed in the block (numba_moe's and numba_moe_q8's
    kernels, one format or a file's two) give the parts' logits, and the CPU executor counts
    the same routes."""
    path = demo_checkpoint if model == "demo" else kquant_gguf
    prompts = PROMPTS[:2] if model == "demo" else [PROMPT_IDS, PROMPT_IDS[:3]]
    blocks(monkeypatch, False)
    parts_routes, routes = [], []
    parts = decode_logits(path, "bfloat16", prompts, routes=parts_routes, **formats)
    blocks(monkeypatch, True)
    routed = []
    block_calls(monkeypatch, routed)
    got = decode_logits(path, "bfloat16", prompts, routes=routes, **formats)
    assert_same_logits(got, parts)
    assert any(kind == "experts" for _, kind in routed)
    assert routes == parts_routes and routes[0] > 0


def test_experts_on_other_threads_stay_the_layers(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An expert kernel on another thread count than the block's (one launch has one): the
    block routes and the MoE layer computes the experts, with the same bits."""
    blocks(monkeypatch, False)
    parts = decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:1], cpu_threads=1)
    blocks(monkeypatch, True)
    routed = []
    block_calls(monkeypatch, routed)
    got = decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:1], cpu_threads=1)
    assert_same_logits(got, parts)
    kinds = {kind for asked, kind in routed if asked}
    assert "routes" in kinds and "experts" not in kinds


def test_experts_computed_otherwise_fail_the_comparison(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experts' comparison can fail: a block whose experts round as float32 activations
    where the bank's bf16 ones round each step."""
    blocks(monkeypatch, False)
    parts = decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:1])
    blocks(monkeypatch, True)
    offer = CpuExperts.block_experts

    def unrounded(self, *args):
        found = offer(self, *args)
        if found is None:
            return None
        formats, bank, (_, *moe), threads = found
        return formats, bank, (0, *moe), threads

    monkeypatch.setattr(CpuExperts, "block_experts", unrounded)
    with pytest.raises(AssertionError, match="decode step 0"):
        assert_same_logits(decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:1]), parts)


def test_a_tie_in_the_router_is_routed_as_torch_does(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gate of zeros: every logit equal; the block picks torch.topk's experts among them
    itself (numba_glue._torch_topk): its ids are torch.topk's of the zero logits, it computes
    those experts, and the logits are the parts'."""

    def zero_gates(model) -> None:
        for layer in model.moe_layers:
            layer.router.gate.weight.zero_()

    blocks(monkeypatch, False)
    parts = decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:1], prepare=zero_gates)
    blocks(monkeypatch, True)
    block_ids, run = [], attention_block._run

    def recording(*args, **kwargs):
        out = run(*args, **kwargs)
        if isinstance(out, tuple) and out[3] is not None:  # routed, experts computed
            block_ids.append(out[2][0].clone())
        return out

    monkeypatch.setattr(attention_block, "_run", recording)
    got = decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:1], prepare=zero_gates)
    assert_same_logits(got, parts)
    assert block_ids
    config = json.loads((demo_checkpoint / "config.json").read_text())
    zeros = torch.zeros(1, config["num_experts"])
    want = torch.topk(zeros, config["num_experts_per_tok"]).indices  # its pick among equals
    assert want.tolist() != [list(range(config["num_experts_per_tok"]))]  # not the lowest
    assert all(torch.equal(ids, want) for ids in block_ids)


# 64 experts, top 1: torch.topk keeps a heap of k for k * 64 <= experts (not reproduced)
HEAP_TOPK_QWEN3 = dict(
    hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_experts=64, num_experts_per_tok=1, moe_intermediate_size=32,
    intermediate_size=64, norm_topk_prob=False,
)  # fmt: skip


def test_a_tie_torch_picks_otherwise_goes_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torch.topk's pick among ties is not the one reproduced (64 experts, top 1), the
    block leaves the tied logits to torch, and the logits are still the parts'."""
    checkpoint = write_custom_checkpoint("qwen3_moe", HEAP_TOPK_QWEN3, tmp_path / "hf")

    def zero_gates(model) -> None:
        for layer in model.moe_layers:
            layer.router.gate.weight.zero_()

    blocks(monkeypatch, False)
    parts = decode_logits(checkpoint, "bfloat16", [PROMPT_IDS], prepare=zero_gates)
    blocks(monkeypatch, True)
    routed = []
    calls = block_calls(monkeypatch, routed)
    got = decode_logits(checkpoint, "bfloat16", [PROMPT_IDS], prepare=zero_gates)
    assert_same_logits(got, parts)
    assert calls and any(asked for asked, _ in routed)
    assert all((kind == "logits") == asked for asked, kind in routed)


def test_a_block_routing_otherwise_fails_the_comparison(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The routing's comparison can fail: a block that renormalises where the router does
    not (or the other way round)."""
    blocks(monkeypatch, False)
    parts = decode_logits(demo_checkpoint, "float32", PROMPTS[:1])
    blocks(monkeypatch, True)
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
    blocks(monkeypatch, False)
    parts = decode_logits(demo_checkpoint, "bfloat16", PROMPTS[:2], kernel="auto")
    kernel_ran = bool(attention_kernel_calls)
    blocks(monkeypatch, True)
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


@pytest.mark.parametrize("block", ["attention", "head"])
def test_a_block_computing_otherwise_fails_the_comparison(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, block: str
) -> None:
    """The comparisons above can fail: an attention block (or the head block) whose norm
    takes another epsilon."""
    blocks(monkeypatch, False)
    parts = decode_logits(demo_checkpoint, "float32", PROMPTS[:1])
    blocks(monkeypatch, True)
    module, name, eps_at = {
        "attention": (attention_block, "_run", 4),  # _run(qkv, o, q_norm, k_norm, eps, ...)
        "head": (transformer, "decode_head", 3),  # decode_head(x, delta, scale, eps, ...)
    }[block]
    call = getattr(module, name)

    def other_eps(*args, **kwargs):
        args = (*args[:eps_at], args[eps_at] * 4 + 1e-3, *args[eps_at + 1 :])
        return call(*args, **kwargs)

    monkeypatch.setattr(module, name, other_eps)
    with pytest.raises(AssertionError, match="decode step 0"):
        assert_same_logits(decode_logits(demo_checkpoint, "float32", PROMPTS[:1]), parts)


def test_the_head_blocks_plan_is_made_again_when_the_head_changes(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head quantised between two generations (--dense-format's quantize_dense) is what the
    head block computes with from then on: the parts' bits with the new head."""
    heads = head_calls(monkeypatch)
    with recording_engine(demo_checkpoint, "bfloat16") as (engine, logits):
        model = engine.model
        engine.generate_ids(PROMPTS[:2], GREEDY)
        before = list(logits)
        model.lm_head.quantize(weight_format("q8_0"), model.dtype)
        logits.clear()
        engine.generate_ids(PROMPTS[:2], GREEDY)
        blocked = list(logits)
        assert heads and all(heads)
        assert not torch.equal(blocked[0], before[0])  # the new head's logits
        blocks(monkeypatch, False)
        logits.clear()
        engine.generate_ids(PROMPTS[:2], GREEDY)
    assert_same_logits(blocked, logits)


def test_a_layers_plan_is_kept_and_made_again_when_a_weight_changes(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_block makes a layer's _Plan (its checks and the block's arguments from the
    layer's parts) on the first decode step and keeps it for the next ones; a weight quantised
    between two generations makes it again: the second generation gives the parts' bits with
    the quantised weights, not the kept plan's old ones."""
    made = []
    plan_init = attention_block._Plan.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        plan_init(self, *args, **kwargs)

    monkeypatch.setattr(attention_block._Plan, "__init__", counting)
    calls = block_calls(monkeypatch)
    with recording_engine(demo_checkpoint, "float32") as (engine, logits):
        model = engine.model
        engine.generate_ids(PROMPTS[:1], GREEDY)
        layers = len(model.layers)
        assert len(calls) == layers * (GREEDY.max_tokens - 1) and len(made) == layers
        for layer in model.layers:
            layer.attn.o_proj.quantize(weight_format("q8_0"))
        logits.clear()
        engine.generate_ids(PROMPTS[:1], GREEDY)
        assert len(made) == 2 * layers
        blocked = list(logits)
        blocks(monkeypatch, False)
        logits.clear()
        engine.generate_ids(PROMPTS[:1], GREEDY)
    assert_same_logits(blocked, logits)


def test_a_layer_keeps_a_few_plans(demo_checkpoint: Path) -> None:
    """Each plan holds its step's arrays: steps of more batch sizes than MAX_PLANS leave a
    layer with MAX_PLANS plans (the oldest dropped), and a batch size met again finds its
    plan (the router's and experts' offers it was made of are the same objects again), with
    a fresh engine's tokens."""
    sizes = [1, 2, 3, 4, 3]
    assert len(set(sizes)) > attention_block.MAX_PLANS
    offload = OffloadConfig(decode_target="cpu", cpu_threads=2)
    config = EngineConfig(dtype="float32", threads=2, attention_kernel="on", offload=offload)
    prompts = PROMPTS + [[11, 12, 13]]
    with Engine.from_pretrained(demo_checkpoint, config) as engine:
        for size in sizes:
            tokens = engine.generate_ids(prompts[:size], GREEDY)
        kept = [len(layer.attn._block_plans) for layer in engine.model.layers]
    assert kept == [attention_block.MAX_PLANS] * len(kept)
    with Engine.from_pretrained(demo_checkpoint, config) as engine:
        assert engine.generate_ids(prompts[:3], GREEDY) == tokens


def test_the_block_runs_its_attention_on_an_awake_pool_with_2_items_a_thread():
    rule = attention_block.block_attention_threads
    assert rule(1, True, 4, 2) == 2  # q/k/v on the pool, 2 items a thread
    assert rule(1, True, 3, 2) == 1  # too few items: the standalone rule's
    assert rule(1, False, 16, 2) == 1  # q/k/v on the calling thread: the pool may sleep
    assert rule(2, False, 1, 2) == 2  # the standalone rule's own parallel step
