"""Load time and RSS: a GGUF with q4_0 experts vs the same checkpoint in safetensors (bf16)
loaded with --expert-format q4_0, side by side in one run.

    python benchmarks/bench_gguf_load.py --gguf-gib 2 --dir /tmp/bench-gguf

Writes a synthetic Qwen3-MoE (random weights) of about `--gguf-gib` GiB of q4_0 experts, once
as safetensors (bf16, per-expert tensors) and once as GGUF (F32 dense, Q4_0 merged experts),
then loads each through Engine.from_pretrained (decode target cpu) and prints the times, the
ratio and the RSS growth of each load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HIDDEN, INTER, EXPERTS, HEADS = 1024, 512, 64, 8


def _layers(gib: float) -> int:
    q4_bytes = 3 * HIDDEN * INTER * 18 // 32 * EXPERTS
    return max(1, int(gib * 2**30 / q4_bytes))


def write_checkpoints(root: Path, layers: int) -> tuple[Path, Path]:
    import gguf
    from safetensors.torch import save_file

    from hybridmoe.quant.formats import weight_format

    hf, gguf_path = root / "hf", root / "model.gguf"
    hf.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 256,
        "hidden_size": HIDDEN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "head_dim": HIDDEN // HEADS, "num_experts": EXPERTS,
        "num_experts_per_tok": 4, "moe_intermediate_size": INTER, "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "dtype": "bfloat16",
    }  # fmt: skip
    (hf / "config.json").write_text(json.dumps(config))
    q4 = weight_format("q4_0")
    writer = gguf.GGUFWriter(str(gguf_path), "qwen3moe")
    for key, value in (("context_length", 4096), ("embedding_length", HIDDEN)):
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_block_count(layers), writer.add_head_count(HEADS), writer.add_head_count_kv(HEADS)
    writer.add_key_length(HIDDEN // HEADS), writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(4), writer.add_expert_feed_forward_length(INTER)
    writer.add_layer_norm_rms_eps(1e-6), writer.add_rope_freq_base(1e6)
    writer.add_vocab_size(256), writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(0x100 + i) for i in range(256)])
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}

    def dense(name: str, gguf_name: str, shape: tuple[int, ...]) -> None:
        value = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        tensors[name] = value.to(torch.bfloat16)
        writer.add_tensor(gguf_name, tensors[name].float().numpy())

    dense("model.embed_tokens.weight", "token_embd.weight", (256, HIDDEN))
    dense("model.norm.weight", "output_norm.weight", (HIDDEN,))
    dense("lm_head.weight", "output.weight", (256, HIDDEN))
    for i in range(layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        for hf_part, part, shape in (
            ("input_layernorm", "attn_norm", (HIDDEN,)),
            ("post_attention_layernorm", "ffn_norm", (HIDDEN,)),
            ("self_attn.q_norm", "attn_q_norm", (HIDDEN // HEADS,)),
            ("self_attn.k_norm", "attn_k_norm", (HIDDEN // HEADS,)),
            ("self_attn.q_proj", "attn_q", (HIDDEN, HIDDEN)),
            ("self_attn.k_proj", "attn_k", (HIDDEN, HIDDEN)),
            ("self_attn.v_proj", "attn_v", (HIDDEN, HIDDEN)),
            ("self_attn.o_proj", "attn_output", (HIDDEN, HIDDEN)),
            ("mlp.gate", "ffn_gate_inp", (EXPERTS, HIDDEN)),
        ):
            dense(f"{p}.{hf_part}.weight", f"{b}.{part}.weight", shape)
        for proj, part, shape in (
            ("gate_proj", "ffn_gate_exps", (INTER, HIDDEN)),
            ("up_proj", "ffn_up_exps", (INTER, HIDDEN)),
            ("down_proj", "ffn_down_exps", (HIDDEN, INTER)),
        ):
            stacked = (torch.randn((EXPERTS, *shape), generator=g) / shape[-1] ** 0.5).bfloat16()
            for e in range(EXPERTS):
                tensors[f"{p}.mlp.experts.{e}.{proj}.weight"] = stacked[e].clone()
            blocks = q4.quantize(stacked.float()).numpy()
            writer.add_tensor(
                f"{b}.{part}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_0
            )
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    writer.write_header_to_file(), writer.write_kv_data_to_file()
    writer.write_tensors_to_file(), writer.close()
    return hf, gguf_path


def load_once(path: str, expert_format: str | None) -> None:
    """In a fresh process: load, print seconds and RSS growth (MiB) as JSON."""
    from hybridmoe.engine import Engine, EngineConfig
    from hybridmoe.moe.config import OffloadConfig

    offload = OffloadConfig(decode_target="cpu", expert_format=expert_format)
    start_rss = _rss_mib()
    start = time.perf_counter()
    engine = Engine.from_pretrained(path, EngineConfig(offload=offload, max_seq_len=64))
    seconds = time.perf_counter() - start
    print(json.dumps({"s": seconds, "rss_mib": _rss_mib() - start_rss, "peak_mib": _peak_mib()}))
    engine.close()


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _rss_mib() -> float:
    return _status_mib("VmRSS")


def _peak_mib() -> float:
    """The process's peak RSS (VmHWM; ru_maxrss would carry the parent's over exec)."""
    return _status_mib("VmHWM")


def _measure(path: Path, expert_format: str | None) -> dict:
    args = [sys.executable, __file__, "--load", str(path)]
    args += ["--expert-format", expert_format] if expert_format else []
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf-gib", type=float, default=2.0)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench-gguf"))
    parser.add_argument("--load", default=None)
    parser.add_argument("--expert-format", default=None)
    args = parser.parse_args()
    if args.load:
        return load_once(args.load, args.expert_format)
    layers = _layers(args.gguf_gib)
    hf, gguf_path = args.dir / "hf", args.dir / "model.gguf"
    if not (gguf_path.exists() and (hf / "model.safetensors").exists()):  # else: reused
        hf, gguf_path = write_checkpoints(args.dir, layers)
    print(f"{layers} layers; GGUF {gguf_path.stat().st_size / 2**30:.2f} GiB, safetensors "
          f"{(hf / 'model.safetensors').stat().st_size / 2**30:.2f} GiB; loadavg "
          f"{Path('/proc/loadavg').read_text().split()[0]}")  # fmt: skip
    safetensors = _measure(hf, "q4_0")
    from_gguf = _measure(gguf_path, None)
    print(f"safetensors + --expert-format q4_0: {safetensors}")
    print(f"GGUF (q4_0 experts):                {from_gguf}")
    print("rss_mib: RSS growth over the load (what stays resident); peak_mib: VmHWM")
    print(f"load time ratio safetensors/GGUF: {safetensors['s'] / from_gguf['s']:.1f}x")


if __name__ == "__main__":
    main()
