"""bench_vs_llamacpp.py's k-quant files at a tiny shape of whole 256-weight super-blocks: the
experts are seeded random blocks of the format's ggml types (q4_k_m: llama.cpp's Q4_K_M rule),
finite and small once dequantised by gguf.quants; hybridmoe decodes them with the bench's own
config, experts in the file's types and memory-mapped, as the float model gguf.quants says
they stand for. Only the last test needs llama-cpp-python (skipped without it)."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_vs_llamacpp import Round, _logits_agreement  # noqa: E402
from llamacpp_checkpoints import dense_type, ensure_files, expert_type, write_gguf  # noqa: E402
from llamacpp_workers import hybridmoe_config, llamacpp_last_logits, measure, prompts  # noqa: E402

from hybridmoe.engine import Engine, EngineConfig  # noqa: E402
from hybridmoe.moe.config import OffloadConfig  # noqa: E402

K_FORMATS = ("q4_k", "q5_k", "q6_k", "q4_k_m")
PROJECTIONS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return ensure_files("tiny-k", tmp_path_factory.mktemp("bench-kquants"), ("bf16", *K_FORMATS))


def _tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_q4_k_m_is_llamacpps_mix() -> None:
    """Q6_K down in the first and last eighth and every third layer between, Q4_K elsewhere."""
    for layers, more_bits in ((8, {0, 3, 6, 7}), (5, {2, 4}), (2, {1})):
        downs = {
            i for i in range(layers) if expert_type("q4_k_m", i, "down_proj", layers).name == "Q6_K"
        }
        assert downs == more_bits, layers
        gate_up = {
            expert_type("q4_k_m", i, p, layers)
            for i in range(layers)
            for p in ("gate_proj", "up_proj")
        }
        assert gate_up == {QType.Q4_K}
    with pytest.raises(ValueError, match="'q4_k_s'"):
        expert_type("q4_k_s", 0, "down_proj", 2)


def test_q4_k_m_all_dense_tensors_follow_llamacpps_rule() -> None:
    """attn_v and the head Q6_K where Q4_K_M gives them more bits, other matrices Q4_K; norms
    and the router F32; bf16 matrices in every other file."""
    attn = "model.layers.{}.self_attn.{}"
    v_more = {
        i for i in range(8) if dense_type("q4_k_m_all", attn.format(i, "v_proj"), 8).name == "Q6_K"
    }
    assert v_more == {0, 3, 6, 7}
    for proj in ("q_proj", "k_proj", "o_proj"):
        assert {dense_type("q4_k_m_all", attn.format(i, proj), 8) for i in range(8)} == {QType.Q4_K}
    assert dense_type("q4_k_m_all", "lm_head", 8) == QType.Q6_K
    assert dense_type("q4_k_m_all", "model.embed_tokens", 8) == QType.Q4_K
    for base in ("model.layers.0.mlp.gate", "model.layers.0.input_layernorm", "model.norm"):
        assert dense_type("q4_k_m_all", base, 8) == QType.F32
    for fmt in ("q4_k_m", "q4_k", "q8_0"):
        assert dense_type(fmt, attn.format(0, "v_proj"), 8) == QType.BF16
        assert dense_type(fmt, "lm_head", 8) == QType.BF16


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_experts_are_small_finite_blocks_of_the_formats_types(files, fmt: str) -> None:
    """Each merged expert tensor's ggml type is the format's; gguf.quants dequantises it to
    finite weights of about the checkpoint's std (0.02); dense tensors are the bf16 file's."""
    tensors, dense = _tensors(files[fmt]), _tensors(files["bf16"])
    types = set()
    for name, tensor in tensors.items():
        if not name.endswith("_exps.weight"):
            np.testing.assert_array_equal(tensor.data, dense[name].data)
            continue
        layer, kind = int(name.split(".")[1]), name.split(".")[2]
        assert tensor.tensor_type == expert_type(fmt, layer, PROJECTIONS[kind], 2), name
        weights = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        assert np.isfinite(weights).all() and 0.01 < weights.std() < 0.04, name
        types.add(tensor.tensor_type.name)
    assert types == ({"Q4_K", "Q6_K"} if fmt == "q4_k_m" else {fmt.upper()})


def test_a_tensors_bytes_depend_on_its_type_not_the_file(files) -> None:
    mix, q4_k, q6_k = (_tensors(files[f]) for f in ("q4_k_m", "q4_k", "q6_k"))
    np.testing.assert_array_equal(
        mix["blk.0.ffn_down_exps.weight"].data, q4_k["blk.0.ffn_down_exps.weight"].data
    )
    np.testing.assert_array_equal(
        mix["blk.1.ffn_down_exps.weight"].data, q6_k["blk.1.ffn_down_exps.weight"].data
    )


def test_rows_of_partial_super_blocks_are_refused(files, tmp_path: Path) -> None:
    tiny = ensure_files("tiny", tmp_path, ())["safetensors"]  # rows of 64 weights
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_exps\.weight: rows of 64 .* Q4_K"):
        write_gguf(tiny, tmp_path / "bad.gguf", "q4_k")


def _dequantised_checkpoint(files, fmt: str, out: Path) -> Path:
    """The bench's safetensors checkpoint with the experts the GGUF of `fmt` holds, float32."""
    out.mkdir()
    source = files["safetensors"]
    (out / "config.json").write_text((source / "config.json").read_text())
    tensors = {k: v for f in sorted(source.glob("*.safetensors")) for k, v in load_file(f).items()}
    for name, tensor in _tensors(files[fmt]).items():
        if name.endswith("_exps.weight"):
            layer, kind = int(name.split(".")[1]), name.split(".")[2]
            weights = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
            for e, matrix in enumerate(torch.from_numpy(weights.copy())):  # [rows, n]
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{PROJECTIONS[kind]}.weight"] = matrix
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _logits(path: Path, prompt: list[int]) -> torch.Tensor:
    """Float activations: the float checkpoint's arithmetic (the default is q8 for k-quants)."""
    offload = OffloadConfig(decode_target="cpu", activation_quant="none")
    config = EngineConfig(dtype="float32", offload=offload)
    with Engine.from_pretrained(path, config) as engine:
        return engine.model.logits(prompt).float()  # [T, V]


@pytest.mark.parametrize("fmt", ("q5_k", "q4_k_m"))
def test_gguf_computes_the_model_its_blocks_stand_for(files, fmt: str, tmp_path: Path) -> None:
    """hybridmoe's logits on the GGUF (k-quant kernels) are those of the float checkpoint of
    its dequantised experts (dense kernels): float summation order apart, the same model."""
    prompt = prompts(1, 16)[0]
    ours = _logits(files[fmt], prompt)
    reference = _logits(_dequantised_checkpoint(files, fmt, tmp_path / "float"), prompt)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, reference, atol=1e-4 * reference.abs().max().item(), rtol=0)


def _mapped(path: Path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps the file at `path`."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [
        tuple(int(x, 16) for x in ln.split()[0].split("-"))
        for ln in lines
        if ln.endswith(str(path))
    ]


def test_bench_config_keeps_the_files_experts_mapped(files, worker_run) -> None:
    """With the bench's config, each layer's bank holds the file's types (Q4_K gate/up, the
    layer's down type) as views of the mapped file: nothing converted or copied."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps")
    with Engine.from_pretrained(files["q4_k_m"], hybridmoe_config(1, worker_run.batch)) as engine:
        ranges = _mapped(files["q4_k_m"])
        for layer, moe in enumerate(engine.model.moe_layers):
            bank = moe.experts.cpu_executor.banks[layer]  # what decode computes from
            down = expert_type("q4_k_m", layer, "down_proj", 2).name.lower()
            assert [f.name for f in bank.formats] == ["q4_k", down]
            for t in (bank.gate, bank.up, bank.down):
                assert any(start <= t.data_ptr() < end for start, end in ranges)


@pytest.mark.parametrize("engine", ("hybridmoe", "llama.cpp"))
def test_workers_decode_kquant_files_with_finite_logits(files, engine: str, worker_run) -> None:
    if engine == "llama.cpp":
        pytest.importorskip("llama_cpp")
    result = measure(engine, files["q4_k_m"], 1, worker_run)
    assert (
        len(result["tokens"]) == worker_run.tokens and result["batch_tokens"][0] == result["tokens"]
    )
    assert np.isfinite(result["prompt_logits"]).all()


def test_llamacpp_reads_the_kquant_file_as_hybridmoe_does(files) -> None:
    """llama.cpp's logits after a prompt match hybridmoe's (float32) on the q4_k_m file, and
    the first greedy token is the same."""
    pytest.importorskip("llama_cpp")
    prompt = prompts(1, 16)[0]
    theirs = torch.from_numpy(llamacpp_last_logits(files["q4_k_m"], prompt))
    ours = _logits(files["q4_k_m"], prompt)[-1]
    torch.testing.assert_close(theirs, ours, atol=0.02 * ours.abs().max().item(), rtol=0.0)
    assert theirs.argmax() == ours.argmax()


def test_report_says_whether_logits_are_finite_and_alike() -> None:
    def agreement(ours: list[float], theirs: list[float]) -> str:
        results = {"hybridmoe": {"prompt_logits": ours}, "llama.cpp": {"prompt_logits": theirs}}
        return _logits_agreement(Round("q4_k", 1, 0.0, 0.0, 10.0, False, results))

    assert agreement([1.0, -4.0], [1.2, -4.0]) == (
        "logits finite, max |difference| 5.0 % of max |logit|"
    )
    assert agreement([1.0, float("nan")], [1.0, 2.0]) == "LOGITS NOT FINITE (finite: llama.cpp)"
    assert agreement([float("inf")], [float("nan")]) == "LOGITS NOT FINITE (finite: neither)"
