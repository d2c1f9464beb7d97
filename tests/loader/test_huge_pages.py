"""loader/huge_pages.py (`--huge-pages`): a GGUF's mapping moved onto anonymous memory in
place. The views made before the move read the file's bytes after it, the addresses no longer
map the file, a model loaded so computes what the mapped one does, and a system or checkpoint
that cannot is refused by name."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gguf_checkpoints import write_gguf
from hf_checkpoints import write_hf_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.errors import CheckpointError
from hybridmoe.loader import gguf as gguf_module
from hybridmoe.loader import huge_pages
from hybridmoe.loader.gguf import GgufFile, streamed_whole
from hybridmoe.models.loading import load_checkpoint
from hybridmoe.moe.config import OffloadConfig
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.formats import weight_format

needs_huge_pages = pytest.mark.skipif(
    not huge_pages.huge_pages_supported(), reason="no transparent huge pages on this system"
)


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps; "hg": MADV_HUGEPAGE)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(a, 16) for a in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def _mapped_files(start: int, end: int) -> set[str]:
    """The paths /proc/self/maps names for mappings overlapping [start, end) ('' anonymous)."""
    names = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(a, 16) for a in fields[0].split("-"))
        if low < end and start < high:
            names.add(fields[5].strip() if len(fields) > 5 else "")
    return names


@needs_huge_pages
@pytest.mark.parametrize("size", [1, 4096 * 3 + 5, (5 << 20) + 123])  # < a page, pages, > 2 MiB
def test_move_keeps_every_view_and_leaves_the_file(tmp_path: Path, size: int) -> None:
    path = tmp_path / "blob.bin"
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    mapped = np.memmap(path, mode="c").view(np.ndarray)
    view = mapped[size // 3 :]  # made before the move, as GgufFile's tensors are
    start = mapped.ctypes.data
    assert _mapped_files(start, start + size) == {str(path)}
    seen = []
    assert huge_pages.move_to_huge_pages(mapped, seen.append)
    assert sum(seen) == size
    assert mapped.ctypes.data == start
    assert np.array_equal(mapped, data) and np.array_equal(view, data[size // 3 :])
    assert str(path) not in _mapped_files(start, start + size)
    assert "hg" in _vm_flags(start)  # advised before the copy; moved with it
    mapped[0] ^= 0xFF  # private memory: the file keeps its bytes
    assert path.read_bytes() == data.tobytes()


@pytest.mark.parametrize("target", [0, 4096, (2 << 20) - 4096, (7 << 20) + 8192])
@pytest.mark.parametrize("reserved", [4096, 2 << 20, (3 << 20) + 4096 * 5])
def test_copy_address_agrees_with_the_target_mod_a_huge_page(reserved: int, target: int) -> None:
    copy = huge_pages.aligned_like(reserved, target)
    assert reserved <= copy < reserved + huge_pages.HUGE_PAGE_BYTES
    assert (copy - target) % huge_pages.HUGE_PAGE_BYTES == 0


def test_empty_mapping_is_not_moved() -> None:
    assert not huge_pages.move_to_huge_pages(np.empty(0, np.uint8))


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf_huge_pages")
    hf = write_hf_checkpoint("qwen3_moe", "mha_tied_top1", root / "hf")
    return write_gguf(hf, root / "model.gguf", "Q4_0")


@needs_huge_pages
def test_gguf_on_huge_pages_reads_the_files_bytes(model_file: Path) -> None:
    """Every tensor of the file reads the copy: the mapped file's bytes, elsewhere."""
    moved = GgufFile(model_file, huge_pages="all")
    storage = next(iter(moved.tensors.values())).data.untyped_storage()
    start = storage.data_ptr()
    assert str(model_file) not in _mapped_files(start, start + storage.nbytes())
    mapped = GgufFile(model_file)
    for name, tensor in moved.tensors.items():
        assert torch.equal(tensor.data, mapped.tensors[name].data), name


TARGETS = {
    "cpu": OffloadConfig(decode_target="cpu"),
    "hybrid": OffloadConfig(decode_target="hybrid", expert_cache_slots=2, max_fetch=1),
    "offload": OffloadConfig(decode_target="offload"),
    "gpu": OffloadConfig(decode_target="gpu"),
}


@needs_huge_pages
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_mode_decodes_as_mapped(model_file: Path, monkeypatch, target: str, dtype: str):
    """The engine's greedy tokens and logits with the file all mapped, its streamed tensors
    moved (the cpu device's default) and all of it moved (--huge-pages): the same bits, on
    every decode target, in float32 and bfloat16."""
    from hybridmoe.engine import engine as engine_module

    config = EngineConfig(
        device="cpu", dtype=dtype, max_batch=1, max_seq_len=64, offload=TARGETS[target]
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for mode in ("none", "streamed", "all"):
        monkeypatch.setattr(engine_module, "_huge_pages", lambda config, mode=mode: mode)
        engine = Engine.from_pretrained(model_file, config)
        try:
            ids = engine.generate_ids([[3, 14, 15, 9, 2]], params)
            outputs.append((ids, engine.model.logits([3, 14, 15, 9, 2])))
        finally:
            engine.close()
    for ids, logits in outputs[1:]:
        assert ids == outputs[0][0]
        assert torch.equal(logits, outputs[0][1])


def test_system_without_huge_pages_is_refused(model_file: Path, monkeypatch) -> None:
    monkeypatch.setattr(huge_pages, "huge_pages_supported", lambda: False)
    with pytest.raises(CheckpointError, match="--huge-pages: this system has no transparent"):
        GgufFile(model_file, huge_pages="all")


def test_refused_move_is_an_error(model_file: Path, monkeypatch) -> None:
    monkeypatch.setattr(huge_pages, "huge_pages_supported", lambda: True)
    monkeypatch.setattr(huge_pages, "move_to_huge_pages", lambda *a: False)
    with pytest.raises(CheckpointError, match="model.gguf: --huge-pages: the kernel refused"):
        GgufFile(model_file, huge_pages="all")
    assert gguf_module.GgufFile(model_file).tensors  # the plain load is untouched


def test_huge_pages_refused_for_a_hugging_face_checkpoint(tmp_path: Path) -> None:
    hf = write_hf_checkpoint("qwen3_moe", "mha_tied_top1", tmp_path / "hf")
    with pytest.raises(CheckpointError, match="--huge-pages applies to GGUF files"):
        load_checkpoint(hf, huge_pages="all")


@needs_huge_pages
@pytest.mark.parametrize("fmt", ["bf16", "q4_0"])
def test_host_bank_storage_is_advised_onto_huge_pages(fmt: str) -> None:
    """A bank's storage made at load (stacked, quantised) asks for huge pages on every whole
    2 MiB page inside it, before it is written; a tensor spanning none is left alone."""
    bank = ExpertBank.empty_like_tensor(weight_format(fmt), (8, 512, 2048), "cpu")  # 8-16 MiB
    start = bank.data_ptr()
    first = -(-start // huge_pages.HUGE_PAGE_BYTES) * huge_pages.HUGE_PAGE_BYTES
    assert "hg" in _vm_flags(first)
    assert "hg" in _vm_flags(start + bank.nbytes - huge_pages.HUGE_PAGE_BYTES - 1)


def test_advice_covers_the_whole_huge_pages_inside_a_tensor(monkeypatch) -> None:
    """One madvise over the 2 MiB pages inside the storage; none for a tensor spanning none
    (the calls recorded: where small tensors land in the heap is the allocator's choice)."""
    calls = []
    monkeypatch.setattr(huge_pages, "huge_pages_supported", lambda: True)
    monkeypatch.setattr(
        huge_pages, "_libc", lambda: SimpleNamespace(madvise=lambda *a: calls.append(a))
    )
    huge_pages.advise_huge_pages(torch.empty(100, dtype=torch.uint8))
    assert calls == []
    big = torch.empty(6 << 20, dtype=torch.uint8)
    huge_pages.advise_huge_pages(big)
    ((address, length, advice),) = calls
    size = huge_pages.HUGE_PAGE_BYTES
    assert advice == 14 and address % size == 0 and length >= 2 * size and length % size == 0
    assert big.data_ptr() <= address and address + length <= big.data_ptr() + big.nbytes
    assert address - big.data_ptr() < size and big.data_ptr() + big.nbytes - address - length < size


@needs_huge_pages
def test_streamed_tensors_move_the_experts_stay_mapped(model_file: Path) -> None:
    """The cpu device's default (engine._huge_pages): the whole pages of the tensors a decode
    step reads whole (attention, norms, router, the tied embeddings that are the head) no
    longer map the file; every byte of the routed experts still does (mapped, as issue 15's
    RSS rule asks: tests/benchmarks/test_bench_kquants.py checks it through the engine)."""
    gguf = GgufFile(model_file, huge_pages="streamed")
    gguf.wait_for_huge_pages()
    tensors = gguf.tensors
    names = set(tensors)
    experts = [n for n in names if not streamed_whole(n, names)]
    assert experts and all("_exps." in n for n in experts)
    assert streamed_whole("token_embd.weight", names)  # this file's head is the embeddings
    page, moved = os.sysconf("SC_PAGE_SIZE"), 0
    for name, tensor in tensors.items():
        start, end = tensor.data.data_ptr(), tensor.data.data_ptr() + tensor.data.nbytes
        if name in experts:
            assert _mapped_files(start, end) == {str(model_file)}, name
            continue
        first, last = -(-start // page) * page, end // page * page
        if last > first:  # its whole pages (with its run's neighbours: more may move)
            assert str(model_file) not in _mapped_files(first, last), name
            moved += 1
    assert moved  # some streamed tensor spans whole pages


def test_streamed_move_runs_beside_the_load(model_file: Path, monkeypatch) -> None:
    """The load returns while the streamed tensors' move is still running (held here until
    released), its tensors readable meanwhile; wait_for_huge_pages returns once it is over,
    having moved each part's runs of streamed tensors."""
    release, calls = threading.Event(), []

    def held_move(mapped, runs):
        assert release.wait(timeout=60)
        calls.append((mapped.nbytes, [tuple(run) for run in runs]))

    monkeypatch.setattr(huge_pages, "huge_pages_supported", lambda: True)
    monkeypatch.setattr(huge_pages, "move_ranges_to_huge_pages", held_move)
    gguf = GgufFile(model_file, huge_pages="streamed")
    plain = GgufFile(model_file)
    assert calls == []  # the move has not run: the load did not wait for it
    for name, tensor in plain.tensors.items():
        assert torch.equal(gguf.tensors[name].data, tensor.data), name
    release.set()
    gguf.wait_for_huge_pages()
    ((nbytes, runs),) = calls
    assert nbytes == model_file.stat().st_size and runs
    assert all(start < end <= nbytes for start, end in runs)
    plain.wait_for_huge_pages()  # none runs: returns at once


def test_failed_streamed_move_is_logged_and_leaves_the_file(
    model_file: Path, monkeypatch, caplog
) -> None:
    """A move that raises in its thread leaves every tensor on the file's pages, readable,
    and says so in a warning (the load itself goes on: the move is an optimisation)."""

    def failing_move(mapped, runs):
        raise OSError("no memory for the copy")

    monkeypatch.setattr(huge_pages, "huge_pages_supported", lambda: True)
    monkeypatch.setattr(huge_pages, "move_ranges_to_huge_pages", failing_move)
    with caplog.at_level(logging.WARNING, logger="hybridmoe.loader.gguf"):
        gguf = GgufFile(model_file, huge_pages="streamed")
        gguf.wait_for_huge_pages()
    assert "huge-page move failed: no memory for the copy" in caplog.text
    for tensor in gguf.tensors.values():
        start = tensor.data.data_ptr()
        assert _mapped_files(start, start + max(tensor.data.nbytes, 1)) == {str(model_file)}


def test_streamed_whole_keeps_experts_and_untied_embeddings_mapped() -> None:
    names = {"token_embd.weight", "output.weight", "blk.0.ffn_up_exps.weight"}
    assert not streamed_whole("blk.0.ffn_up_exps.weight", names)
    assert not streamed_whole("blk.3.ffn_gate_exps.bias", names)
    assert not streamed_whole("token_embd.weight", names)
    assert streamed_whole("token_embd.weight", names - {"output.weight"})
    for dense in ("output.weight", "blk.0.attn_q.weight", "blk.0.ffn_gate_inp.weight"):
        assert streamed_whole(dense, names)
    assert streamed_whole("blk.0.ffn_up_shexp.weight", names)  # a shared expert: every step


def test_engine_moves_streamed_tensors_on_the_cpu_device_only(monkeypatch) -> None:
    """--huge-pages: all; else the streamed tensors where the host computes on them (the
    cpu device), nothing where an accelerator takes the dense weights."""
    from hybridmoe.engine import engine as engine_module

    cpu = EngineConfig(device="cpu")
    assert engine_module._huge_pages(cpu) == "streamed"
    assert engine_module._huge_pages(dataclasses.replace(cpu, huge_pages=True)) == "all"
    monkeypatch.setattr(engine_module, "resolve_device", lambda spec: torch.device("cuda", 0))
    assert engine_module._huge_pages(EngineConfig(device="cuda")) == "none"


def test_plain_file_stays_mapped(model_file: Path) -> None:
    tensors = GgufFile(model_file).tensors  # huge_pages="none"
    storage = next(iter(tensors.values())).data.untyped_storage()
    start = storage.data_ptr()
    assert _mapped_files(start, start + storage.nbytes()) == {str(model_file)}
    with pytest.raises(ValueError, match="huge_pages must be one of"):
        GgufFile(model_file, huge_pages="some")
