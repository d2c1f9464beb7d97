"""ExpertPrefill and LayerStreamer: prefill's routed experts streamed layer by layer or computed
on the CPU, exact either way, with the stream's copies ordered as the platform contract says."""

from __future__ import annotations

import pytest
import torch

from hf_checkpoints import PROMPT_IDS, SHORT_PROMPT_IDS, write_hf_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.moe.cpu_experts import bank_moe
from hybridmoe.moe.prefill import ExpertPrefill, InPlacePrefill, LayerStreamer
from hybridmoe.platform.cpu import CpuPlatform
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import weight_format
from random_weights import random_stored

E, H, INTER = 4, 16, 8
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def make_banks(layers: int) -> list[ExpertBank]:
    gen = torch.Generator().manual_seed(layers)
    shapes = ((E, 2 * INTER, H), (E, H, INTER))
    return [
        ExpertBank(*(torch.randn(shape, generator=gen) for shape in shapes)) for _ in range(layers)
    ]


class RecordingPlatform(CpuPlatform):
    """The cpu platform, logging which layer's copies start and finish."""

    def __init__(self, banks: list[ExpertBank]):
        self.banks, self.log = banks, []

    def start_copies(self, copies):
        layer = next(i for i, b in enumerate(self.banks) if b.gate_up is copies[0][0])
        self.log.append(("start", layer))
        super().start_copies(copies)
        return layer

    def finish_copies(self, handle):
        self.log.append(("finish", handle))


EXPECTED_COPIES = {1: [0], 2: [0, 1], 3: [0, 1, 2, 0, 2], 4: [0, 1, 2, 3, 0, 1, 2, 3, 0]}


@pytest.mark.parametrize("layers", sorted(EXPECTED_COPIES))
def test_streamer_gives_each_layer_and_prefetches_the_next(layers):
    banks = make_banks(layers)
    platform = RecordingPlatform(banks)
    streamer = LayerStreamer(banks, platform)
    for _ in range(2):  # two prompts: the second starts from the prefetched first layer
        for layer in range(layers):
            bank = streamer.bank_for(layer)
            assert torch.equal(bank.gate_up, banks[layer].gate_up), f"layer {layer}"
            assert torch.equal(bank.down, banks[layer].down), f"layer {layer}"
            if layer + 1 < layers:  # the following layer's copy started before this one computes
                assert ("start", layer + 1) in platform.log
    starts = [layer for kind, layer in platform.log if kind == "start"]
    # Up to two layers stay in the two buffers. Beyond, the last layer prefetches the first for
    # the next prompt, unless they share a buffer (an odd count), when it must not refill it.
    assert starts == EXPECTED_COPIES[layers]
    # every use waits (device-side) for exactly its own layer's copy
    finishes = [entry[1] for entry in platform.log if entry[0] == "finish"]
    assert finishes == list(range(layers)) * 2


def test_streamer_never_refills_the_buffer_being_read():
    """With an odd layer count the last layer and the first share a buffer: no prefetch then,
    or the copy would overwrite the weights the last layer is about to read."""
    banks = make_banks(3)
    streamer = LayerStreamer(banks, CpuPlatform())
    for layer in range(3):
        bank = streamer.bank_for(layer)
    assert torch.equal(bank.gate_up, banks[2].gate_up)


def test_streamer_buffers_hold_layers_of_different_formats():
    """Layers whose down is in another format (a Q4_K_M GGUF): each buffer is sized for the
    largest and read in the formats of the layer it holds; the grouped reference on it gives
    the host bank's sum."""
    gen = torch.Generator().manual_seed(5)
    banks = []
    for down_name in ("q6_k", "q5_k", "q6_k"):
        fmt, down_fmt = weight_format("q4_k"), weight_format(down_name)
        gate, up = (random_stored(fmt, (E, 256, 256), gen) for _ in range(2))
        down = random_stored(down_fmt, (E, 256, 256), gen)
        banks.append(ExpertBank(gate=gate, up=up, down=down, fmt=fmt, down_fmt=down_fmt))
    streamer = LayerStreamer(banks, CpuPlatform())
    assert LayerStreamer.nbytes(banks) == 2 * banks[0].nbytes  # q6_k down is the larger
    x, ids = torch.randn(3, 256, generator=gen), torch.tensor([[0, 3], [1, 0], [2, 2]])
    weights = torch.rand(3, 2, generator=gen)
    for layer in (0, 1, 2, 0):
        bank = streamer.bank_for(layer)
        assert bank.formats == banks[layer].formats
        assert torch.equal(bank.down, banks[layer].down), f"layer {layer}"
        expected = bank_moe(x, ids, weights, banks[layer])
        assert torch.equal(bank_moe(x, ids, weights, bank), expected), f"layer {layer}"


@pytest.mark.parametrize(
    ("mode", "tokens", "on_cpu"),
    [("cpu", 100, True), ("stream", 1, False), ("auto", 4, True), ("auto", 5, False)],
)
def test_prefill_mode_picks_the_side_and_is_exact(mode, tokens, on_cpu):
    banks = make_banks(2)
    calls = []

    def cpu_fn(*args):
        calls.append(args[0].device)
        return bank_moe(*args)

    prefill = ExpertPrefill(banks, CpuPlatform(), cpu_fn, mode, cpu_tokens=4)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.randint(0, E, (tokens, 2), generator=gen)
    weights = torch.rand(tokens, 2, generator=gen)
    out = prefill(1, x, ids, weights)
    torch.testing.assert_close(out, bank_moe(x, ids, weights, banks[1]))
    assert bool(calls) == on_cpu
    assert (prefill.streamer is None) == (mode == "cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_hf_checkpoint("qwen3_moe", "gqa_head_dim", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def reference_tokens(checkpoint):
    with Engine.from_pretrained(checkpoint, EngineConfig(dtype="float32")) as engine:
        return engine.generate_ids([PROMPT_IDS, SHORT_PROMPT_IDS], GREEDY)


@pytest.mark.parametrize("target", ["offload", "cpu", "hybrid"])
@pytest.mark.parametrize("mode", ["stream", "cpu", "auto"])
def test_every_prefill_mode_gives_the_reference_tokens(checkpoint, reference_tokens, target, mode):
    offload = OffloadConfig(decode_target=target, expert_cache_ratio=0.5, prefill=mode)
    with Engine.from_pretrained(checkpoint, EngineConfig(dtype="float32", offload=offload)) as e:
        assert e.generate_ids([PROMPT_IDS, SHORT_PROMPT_IDS], GREEDY) == reference_tokens
        prefill = e.moe_runtime.prefill
        if mode == "auto":  # on the cpu device the banks are the tier: computed in place
            assert isinstance(prefill, InPlacePrefill)
            return
        assert prefill.mode == mode
        if mode == "stream":
            assert prefill.streamer.layers_copied >= len(e.model.moe_layers)
