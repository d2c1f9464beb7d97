"""benchmarks/bench_vs_llamacpp.py's pieces at the tiny shape: the GGUF files it writes stand for
its safetensors checkpoint (same greedy tokens in hybridmoe, experts in ggml's bytes), the bytes
a token reads, and its workers. The parts that run llama.cpp skip without llama-cpp-python
(the optional `bench` extra, never installed in CI)."""

from __future__ import annotations

import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_vs_llamacpp import Round, _load_row, _row, first_divergence  # noqa: E402
from llamacpp_checkpoints import SHAPES, bytes_read_per_token, ensure_files  # noqa: E402
from llamacpp_workers import MISSING_LLAMA_CPP, llamacpp_last_logits, measure, prompts  # noqa: E402

from hybridmoe.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from hybridmoe.moe.config import OffloadConfig  # noqa: E402

FORMATS = ("bf16", "q8_0", "q4_0")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return ensure_files("tiny", tmp_path_factory.mktemp("bench-vs-llamacpp"), FORMATS)


def _greedy(path: Path, expert_format: str | None = None) -> list[int]:
    offload = OffloadConfig(decode_target="cpu", expert_format=expert_format)
    with Engine.from_pretrained(path, EngineConfig(dtype="float32", offload=offload)) as engine:
        return engine.generate_ids(prompts(1, 16), GREEDY)[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_gguf_decodes_like_the_safetensors_checkpoint(files: dict[str, Path], fmt: str) -> None:
    """The GGUF and the safetensors checkpoint quantised at load to the same format."""
    assert _greedy(files[fmt]) == _greedy(files["safetensors"], fmt)


@pytest.mark.parametrize("fmt", ("q8_0", "q4_0"))
def test_gguf_experts_are_ggmls_quantisation(files: dict[str, Path], fmt: str) -> None:
    """The experts' bytes are what gguf's numpy port of ggml's quantiser makes of the weights."""
    reader = gguf.GGUFReader(files[fmt])
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    directory = files["safetensors"]
    shard = next(directory.glob("model-00002-*.safetensors"))  # layer 0
    with safe_open(shard, framework="pt") as f:
        experts = [f.get_tensor(f"model.layers.0.mlp.experts.{e}.up_proj.weight") for e in range(8)]
    weights = torch.stack(experts).float().numpy()
    expected = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[fmt.upper()])
    np.testing.assert_array_equal(stored["blk.0.ffn_up_exps.weight"], expected)


def test_dense_tensors_are_the_checkpoints_bf16(files: dict[str, Path]) -> None:
    reader = gguf.GGUFReader(files["q4_0"])
    [tensor] = [t for t in reader.tensors if t.name == "blk.1.attn_q.weight"]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.BF16
    shard = next(files["safetensors"].glob("model-00003-*.safetensors"))  # layer 1
    with safe_open(shard, framework="pt") as f:
        expected = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
    stored = torch.from_numpy(np.asarray(tensor.data).copy()).view(torch.bfloat16)
    assert torch.equal(stored.reshape(expected.shape), expected)


def test_bytes_read_per_token_is_the_active_weights(files: dict[str, Path]) -> None:
    """bf16: two bytes per active parameter (bench_decode.Qwen3MoeShape counts them apart), four
    for the F32 norms and routers; quantised experts read fewer."""
    shape = SHAPES["tiny"]
    f32 = [d for n, d in shape.tensor_shapes().items() if len(d) == 1 or "mlp.gate." in n]
    expected = 2 * shape.active_params + 2 * sum(math.prod(d) for d in f32)
    assert bytes_read_per_token(files["bf16"]) == expected
    read = [bytes_read_per_token(files[fmt]) for fmt in FORMATS]
    assert read == sorted(read, reverse=True) and len(set(read)) == 3


def _round(busy: bool, ours: float, theirs: float) -> Round:
    results = {"hybridmoe": {"decode_tok_s": ours}, "llama.cpp": {"decode_tok_s": theirs}}
    return Round("q4_0", 2, 0.0, 0.0, 10.0, busy, results)


def test_rows_take_quiet_rounds_only_and_say_busy_otherwise() -> None:
    quiet_and_busy = [_round(False, 30.0, 60.0), _round(True, 30.0, 10.0)]
    assert _row("q4_0, 2t", quiet_and_busy, "decode_tok_s", 10**8) == (
        "| q4_0, 2t | 30.0 tok/s | 60.0 tok/s | 0.50 | 30 % / 60 % | 1 quiet |"
    )
    all_busy = [_round(True, 30.0, 60.0), _round(True, 30.0, 10.0), _round(True, 30.0, 30.0)]
    assert _row("q4_0, 2t", all_busy, "decode_tok_s") == (
        "| q4_0, 2t | 30.0 tok/s | 30.0 tok/s | 1.00 | 3 BUSY |"
    )


def test_load_rows_show_each_engines_imports_share() -> None:
    def result(load_s: float, import_s: float) -> dict:
        return {"load_s": load_s, "import_s": import_s, "peak_rss_mib": 100.0}

    results = {"hybridmoe": result(2.5, 1.75), "llama.cpp": result(0.5, 0.25)}
    rounds = [Round("q4_0", 2, 0.0, 0.0, 10.0, False, results)]
    assert _load_row("q4_0, 2t", rounds) == (
        "| q4_0, 2t | 2.50 s (1.75 s) | 0.50 s (0.25 s) | 100 MiB | 100 MiB |"
    )


def test_a_worker_holds_nothing_of_either_engine_before_its_timer() -> None:
    """The worker module's imports (what a worker holds when measure() starts timing): each
    engine's own imports then count in its load."""
    code = (
        f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import llamacpp_workers; "
        "print(sorted(m for m in ('torch', 'hybridmoe', 'llama_cpp', 'numba') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def _check_worker(result: dict, run: Namespace) -> None:
    """One request's tokens: as many as asked, the same alone and first in a batch."""
    assert len(result["tokens"]) == run.tokens
    assert result["tokens"][0] == result["first_ids"][0]
    assert len(result["batch_tokens"]) == run.batch
    assert result["batch_tokens"][0] == result["tokens"]
    assert {"load_s", "decode_tok_s", "batch_decode_tok_s", "prefill_tok_s"} <= result.keys()
    assert result["peak_rss_mib"] > 0


def test_hybridmoe_worker_decodes_greedily(files: dict[str, Path], worker_run: Namespace) -> None:
    _check_worker(measure("hybridmoe", files["q8_0"], 1, worker_run), worker_run)


def test_hybridmoe_worker_takes_the_attention_kernel(
    files: dict[str, Path], attention_kernel_calls: list[int], worker_run: Namespace
) -> None:
    """--attention-kernel on reaches the engine: its decode steps call the numba attention
    (alone or in the attention block)."""
    run = Namespace(**{**vars(worker_run), "attention_kernel": "on"})
    _check_worker(measure("hybridmoe", files["q8_0"], 1, run), run)
    assert attention_kernel_calls


def test_missing_llama_cpp_is_named(files: dict[str, Path]) -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("llama-cpp-python is installed")
    script = BENCHMARKS / "bench_vs_llamacpp.py"
    done = subprocess.run(
        [sys.executable, str(script), "--shape", "tiny"], capture_output=True, text=True
    )
    assert done.returncode != 0
    assert MISSING_LLAMA_CPP in done.stderr


def test_llamacpp_reads_the_file_as_hybridmoe_does(files: dict[str, Path]) -> None:
    """llama.cpp's logits after a prompt match hybridmoe's (float32) on the bf16 file: both read
    the converted checkpoint as the same model."""
    pytest.importorskip("llama_cpp")
    prompt = prompts(1, 16)[0]
    theirs = torch.from_numpy(llamacpp_last_logits(files["bf16"], prompt))
    with Engine.from_pretrained(files["bf16"], EngineConfig(dtype="float32")) as engine:
        ours = engine.model.logits(prompt)[-1].float()
    scale = ours.abs().max().item()
    torch.testing.assert_close(theirs, ours, atol=0.02 * scale, rtol=0.0)


def test_llamacpp_worker_decodes_greedily(files: dict[str, Path], worker_run: Namespace) -> None:
    pytest.importorskip("llama_cpp")
    _check_worker(measure("llama.cpp", files["q4_0"], 1, worker_run), worker_run)
