"""No numba kernel compiles inside a CpuMoeExecutor job: a first call compiles (minutes on a
slow or shared machine), and inside a job it counts against timeout_s and fails the request
("CPU experts of layer 0 did not finish within 120 s"). The executor is built as the engine
builds it (engine/moe_runtime.py: the kernel made by create_cpu_expert_fn and passed in), on
the worker path an accelerator uses, for the kinds of bank and activation that compiled in a
job before: biases with gpt-oss's clamped activation, a (gate/up, down) pair of formats, bf16
activations and router weights, one token and several."""

from __future__ import annotations

import threading

import pytest
import torch
from numba.core.dispatcher import Dispatcher

from hybridmoe.moe.cpu_executor import CpuMoeExecutor
from hybridmoe.moe.cpu_experts import bank_moe, compiles_on_first_call, create_cpu_expert_fn
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.expert_math import ExpertActivation, ExpertBiases
from hybridmoe.quant.formats import weight_format

HIDDEN, INTER, EXPERTS = 64, 32, 4


def clamped_bank_with_biases() -> ExpertBank:
    g = torch.Generator().manual_seed(0)
    return ExpertBank(
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2,
        torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2,
        biases=ExpertBiases(
            torch.randn(EXPERTS, 2 * INTER, generator=g), torch.randn(EXPERTS, HIDDEN, generator=g)
        ),
        activation=ExpertActivation("clamped_swiglu", alpha=1.702, limit=7.0),
    )


def mixed_format_bank() -> ExpertBank:
    # a pair no other test uses: its entry point is made, and compiled, on first use
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(EXPERTS, INTER, HIDDEN, generator=g).half() for _ in range(2))
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g).bfloat16()
    return ExpertBank(
        gate=gate, up=up, down=down, fmt=weight_format("f16"), down_fmt=weight_format("bf16")
    )


@pytest.fixture
def compiles_by_thread(monkeypatch) -> list[str]:
    """Names of the threads on which a numba dispatcher met argument types it had no machine
    code for (it compiles then, or loads from the disk cache: either way a first call)."""
    names: list[str] = []
    original = Dispatcher._compile_for_args

    def recording(self, *args, **kwargs):
        names.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Dispatcher, "_compile_for_args", recording)
    return names


def test_the_engines_kernel_is_recognised_as_compiling() -> None:
    assert compiles_on_first_call(create_cpu_expert_fn("numba", threads=1))
    assert not compiles_on_first_call(create_cpu_expert_fn("torch"))
    assert not compiles_on_first_call(lambda x, ids, weights, bank: bank_moe(x, ids, weights, bank))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_no_kernel_compiles_inside_a_job(compiles_by_thread, dtype) -> None:
    banks = [clamped_bank_with_biases(), mixed_format_bank()]
    expert_fn = create_cpu_expert_fn("numba", threads=1)  # as the engine passes it
    with CpuMoeExecutor(banks, expert_fn=expert_fn) as executor:
        assert executor._workers, "the worker path, where timeout_s bounds a job"
        built = len(compiles_by_thread)
        g = torch.Generator().manual_seed(2)
        for tokens in (1, 3):
            for layer in range(len(banks)):
                x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
                ids = torch.randint(0, EXPERTS, (tokens, 2), generator=g)
                weights = torch.rand(tokens, 2, generator=g).to(dtype)
                executor.decode_submit(layer, x, ids, weights)
                out = executor.decode_sync(layer)
                reference = bank_moe(x, ids, weights, banks[layer])
                torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)
        in_jobs = [name for name in compiles_by_thread[built:] if name.startswith("hybridmoe-")]
        assert in_jobs == [], f"{len(in_jobs)} first numba calls inside jobs, on {set(in_jobs)}"
        assert executor.stats[0].routes == executor.stats[1].routes == 2 * (1 + 3)
