"""Stream ordering on the accelerator, with each stream delayed in turn by a spin kernel, so that a
missing wait shows as a wrong value instead of hiding behind a host sync (in an engine the
offload cache reads the router's ids on the host before every fetch, which drains the compute
stream first):

- a fetch (Platform.start_copies) does not overwrite a slot that queued compute work still
  reads; work issued after finish_copies sees the fetched experts;
- the CPU side's inputs are staged after the compute work that writes them, and a staging set
  is reused only once its partial has left for the device;
- a host tensor sent with to_device_no_sync may change at once.

End to end, the offload cache and gathered_moe, driven without any host sync, give exact outputs
with either stream delayed; on a machine with two devices, also for a platform on the second.
"""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels.torch_moe import gathered_moe
from hybridmoe.moe.cpu_experts import bank_moe
from hybridmoe.moe.offload_cache import OffloadMoeCache
from hybridmoe.platform.base import Platform, create_platform, to_device_no_sync
from hybridmoe.quant.bank import ExpertBank

from .device_helpers import spin, spin_cycles, sync_debug_mode

pytestmark = pytest.mark.cuda_only

E, H, INTER = 8, 128, 64
DELAY_S = 0.05  # each spin; a missing wait lets the other stream's work run inside it
# (layer, expert) per cache call: one slot, so every call evicts the previous call's expert
CALLS = [(0, 3), (1, 5), (0, 3), (1, 2), (0, 6)]


@pytest.fixture(scope="module")
def cycles(device: torch.device) -> int:
    return spin_cycles(device, DELAY_S)


@pytest.fixture
def platform(device: torch.device):
    platform = create_platform(device)
    yield platform
    platform.close()


def compute_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.current_stream(device)


def test_a_fetch_waits_for_queued_work_that_reads_its_destination(platform, device, cycles):
    src_pinned = torch.full((1 << 20,), 2.0).pin_memory()
    dst = torch.ones(1 << 20, device=device)
    before, after = torch.empty_like(dst), torch.empty_like(dst)  # no allocation below
    torch.cuda.synchronize(device)
    spin(compute_stream(device), cycles)
    before.copy_(dst)  # queued behind the spin: must read the old contents
    platform.finish_copies(platform.start_copies([(src_pinned, dst)]))
    after.copy_(dst)
    assert torch.equal(before.cpu(), torch.ones(1 << 20)), "the fetch overwrote a slot in use"
    assert torch.equal(after.cpu(), src_pinned)


def test_work_after_finish_copies_sees_a_slow_fetch(platform, device, cycles):
    src_pinned = torch.full((1 << 20,), 2.0).pin_memory()
    dst = torch.ones(1 << 20, device=device)
    seen = torch.empty_like(dst)
    torch.cuda.synchronize(device)
    spin(platform.copy_stream, cycles)  # the fetch queues behind it
    platform.finish_copies(platform.start_copies([(src_pinned, dst)]))
    seen.copy_(dst)
    assert torch.equal(seen.cpu(), src_pinned), "work after finish_copies ran before the fetch"


def test_the_cpu_side_reads_inputs_written_by_queued_compute_work(platform, device, cycles):
    sync = platform.device_sync()
    x_dev = torch.zeros(4, H, device=device)
    torch.cuda.synchronize(device)
    spin(compute_stream(device), cycles)
    x_dev.fill_(3.0)  # queued behind the spin
    (x_host,), handle = sync.to_host([x_dev])
    sync.wait_ready(handle)
    assert torch.equal(x_host, torch.full((4, H), 3.0)), "staged before the compute work ran"


def staging_reuse_waits_for_the_returned_partial(
    platform: Platform, device: torch.device, cycles: int
) -> None:
    sync = platform.device_sync()
    x_dev = torch.ones(2, H, device=device)
    (_,), first = sync.to_host([x_dev])
    sync.wait_ready(first)
    spin(compute_stream(device), cycles)  # the partial's copy to the device queues behind it
    partial = sync.to_device(first, torch.full((2, H), 5.0), device)
    (_,), second = sync.to_host([x_dev])  # while that copy is pending: a new set
    assert second is not first and sync.staging_sets == 2, "a set was reused too early"
    sync.wait_ready(second)
    partial_next = sync.to_device(second, torch.full((2, H), 6.0), device)
    assert torch.equal(partial.cpu(), torch.full((2, H), 5.0))
    assert torch.equal(partial_next.cpu(), torch.full((2, H), 6.0))
    (_,), third = sync.to_host([x_dev])  # every copy has run: a set is reused
    assert third in (first, second) and sync.staging_sets == 2
    sync.wait_ready(third)


def test_a_staging_set_is_reused_only_after_its_partial_has_left(platform, device, cycles):
    staging_reuse_waits_for_the_returned_partial(platform, device, cycles)


def test_a_host_tensor_sent_without_sync_may_change_at_once(device, cycles):
    host = torch.zeros(1 << 16, dtype=torch.long)
    torch.cuda.synchronize(device)
    spin(compute_stream(device), cycles)  # every copy below is still pending when host changes
    sent = []
    with sync_debug_mode("error"):  # and the host never waits
        for value in range(8):
            host.fill_(value)
            sent.append(to_device_no_sync(host, device))
    host.fill_(-1)
    for value, tensor in enumerate(sent):
        assert torch.equal(tensor.cpu(), torch.full((1 << 16,), value)), value


def make_banks() -> list[ExpertBank]:
    """Two layers' banks in pinned memory (torch's: registration is test_resources' subject),
    so that fetches are asynchronous: from pageable memory the host would wait for them."""
    banks = []
    for layer in range(2):
        gen = torch.Generator().manual_seed(layer)
        gate_up = torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5
        down = torch.randn(E, H, INTER, generator=gen) / INTER**0.5
        banks.append(ExpertBank(gate_up.pin_memory(), down.pin_memory()))
    return banks


def offload_decode_with_a_stream_delayed(
    platform: Platform, device: torch.device, cycles: int, delayed: str
) -> None:
    """CALLS through a one-slot OffloadMoeCache and gathered_moe with no host sync in between:
    with the compute stream delayed, each call's expert math is still queued when the next call
    fetches into its slot; with the copy stream delayed, each fetch is still queued when the
    math that reads it is issued. Every output must be the reference's."""
    banks = make_banks()
    cache = OffloadMoeCache(banks, num_slots=1, max_fetch=1, platform=platform)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(9))
    weights = torch.ones(1, 1)
    x_dev, weights_dev = x.to(device), weights.to(device)
    zeros_dev = torch.zeros(1, 1, dtype=torch.long, device=device)
    gathered_moe(x_dev, zeros_dev, weights_dev, cache.slot_bank)  # its temporaries, cached
    torch.cuda.synchronize(device)
    outputs = []
    for layer, expert in CALLS:
        slots = torch.tensor([[expert]])  # host ids: the policy reads them without a sync
        cache.ensure_experts(layer, slots)
        if delayed == "copy":
            spin(platform.copy_stream, cycles)
        cache.copy_missing()
        if delayed == "compute":
            spin(compute_stream(device), cycles)
        slots_dev = to_device_no_sync(slots, device)
        outputs.append(gathered_moe(x_dev, slots_dev, weights_dev, cache.slot_bank))
    assert cache.total_stats().fetched == len(CALLS)
    for (layer, expert), out in zip(CALLS, outputs, strict=True):
        expected = bank_moe(x, torch.tensor([[expert]]), weights, banks[layer])
        torch.testing.assert_close(
            out.float().cpu(), expected.float(), rtol=1e-5, atol=1e-5, msg=f"{delayed} delayed"
        )


@pytest.mark.parametrize("delayed", ["compute", "copy"])
def test_offload_decode_is_exact_with_either_stream_delayed(platform, device, cycles, delayed):
    offload_decode_with_a_stream_delayed(platform, device, cycles, delayed)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two devices"
)
def test_a_platform_on_the_second_device_orders_its_own_streams():
    """Every stream and event call names the platform's device, not the current one."""
    current = torch.cuda.current_device()
    device = torch.device("cuda", (current + 1) % torch.cuda.device_count())
    cycles = spin_cycles(device, DELAY_S)
    platform = create_platform(device)
    try:
        for delayed in ("compute", "copy"):
            offload_decode_with_a_stream_delayed(platform, device, cycles, delayed)
        staging_reuse_waits_for_the_returned_partial(platform, device, cycles)
    finally:
        platform.close()
    assert torch.cuda.current_device() == current
