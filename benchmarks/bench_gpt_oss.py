"""gpt-oss end to end: decode tok/s at batch 1 and 4, hybridmoe against Hugging Face
`transformers` on the same random gpt-oss-shaped checkpoint, side by side in one run
(bench_hybrid_attention.compare: wall and CPU time, tokens compared, the load average), with
the experts in bf16 and in MXFP4 (hybridmoe on the MXFP4 checkpoint as published: `*_blocks`
/ `*_scales`, quant_method "mxfp4"; transformers on the same experts dequantised, exactly, to
bf16: every MXFP4 value is a bf16 value).

    python benchmarks/bench_gpt_oss.py [--shape 2gb|tiny] [--formats bf16,mxfp4] [--tokens 24]
        [--threads 2] [--repeats 2]

--shape 2gb: gpt-oss-120b's layer widths (hidden 2880, experts of 2880, 64 query heads and
8 KV heads of 64, top-4, sliding window 128 on every other layer) with 2 layers, 16 experts
and a 32000 vocabulary: ~1.0B parameters, ~2.1 GB in bf16. The checkpoints go to
--checkpoint-dir (default ~/.cache/hybridmoe/bench-gpt-oss-<shape>: bf16/, mxfp4/ and
mxfp4-dequantised/) and are reused.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from bench_hybrid_attention import (
    add_common_args,
    checkpoint_dir,
    compare,
    engine_config,
    load_average,
)
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from hybridmoe.engine import Engine
from hybridmoe.quant.formats import weight_format

MXFP4 = weight_format("mxfp4")
SHAPES = {
    "2gb": dict(
        vocab_size=32000, hidden_size=2880, intermediate_size=2880, num_hidden_layers=2,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=16,
        num_experts_per_tok=4, sliding_window=128,
    ),
    "tiny": dict(  # the smoke test's: whole MXFP4 blocks (hidden, intermediate % 32 == 0)
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8,
    ),
}  # fmt: skip
_COMMON = dict(max_position_embeddings=4096, layer_types=None)
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # [E, in, out] each in transformers
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"]


def ensure_bf16(shape: str, directory: Path) -> Path:
    """The random bf16 checkpoint of SHAPES[shape] (written once, reused)."""
    if (directory / "config.json").exists():
        return directory
    print(f"building the random {shape} gpt-oss checkpoint in {directory} ...", flush=True)
    start = time.perf_counter()
    config = transformers.GptOssConfig(**{**_COMMON, **SHAPES[shape]})
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    print(f"  {params / 1e9:.2f}B parameters initialised in {time.perf_counter() - start:.0f} s")
    model.save_pretrained(directory)
    print(f"  written ({time.perf_counter() - start:.0f} s)", flush=True)
    return directory


def hf_layout(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our mxfp4 bytes uint8 [..., 17 G] (GGUF's: scale byte, 16 bytes of codes) -> the
    Hugging Face (blocks [..., G, 16], scales [..., G]), byte j of a block holding weights
    2j and 2j + 1 (the inverse of quant/mxfp4_hf.hf_blocks_to_mxfp4)."""
    groups = stored.view(*stored.shape[:-1], -1, 17)  # [..., G, 17]
    qs = groups[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [..., G, 32], weight order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks.contiguous(), groups[..., 0].contiguous()


def ensure_mxfp4(bf16: Path, root: Path) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint of bf16's experts, the bf16 checkpoint of those experts
    dequantised), written once from `bf16`."""
    mxfp4, dequantised = root / "mxfp4", root / "mxfp4-dequantised"
    if (mxfp4 / "config.json").exists() and (dequantised / "config.json").exists():
        return mxfp4, dequantised
    tensors = {}
    for shard in sorted(bf16.glob("*.safetensors")):
        tensors.update(load_file(shard))
    quantised, exact = dict(tensors), dict(tensors)
    names = [n for n in tensors if n.endswith(EXPERTS)]
    for name in tqdm(names, desc="quantising experts to mxfp4", unit="tensor"):
        rows = tensors.pop(name).transpose(1, 2).contiguous()  # [E, out, in]: the blocks' rows
        stored = MXFP4.quantize(rows)
        del quantised[name]
        quantised[f"{name}_blocks"], quantised[f"{name}_scales"] = hf_layout(stored)
        exact[name] = MXFP4.dequantize(stored, torch.bfloat16).transpose(1, 2).contiguous()
    config = json.loads((bf16 / "config.json").read_text())
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    for directory, weights, cfg in (
        (mxfp4, quantised, {**config, "quantization_config": quant}),
        (dequantised, exact, config),
    ):
        directory.mkdir(parents=True, exist_ok=True)
        save_file(weights, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps(cfg))
    return mxfp4, dequantised


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, SHAPES, "bench-gpt-oss")
    parser.add_argument("--formats", default="bf16,mxfp4", help="expert formats to run")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    root = checkpoint_dir(args)
    bf16 = ensure_bf16(args.shape, root / "bf16")
    pairs = {"bf16": (bf16, bf16)}  # format -> (ours, transformers')
    if "mxfp4" in args.formats.split(","):
        pairs["mxfp4"] = ensure_mxfp4(bf16, root)
    for fmt in args.formats.split(","):
        ours, theirs = pairs[fmt]
        hf = transformers.GptOssForCausalLM.from_pretrained(theirs, dtype=torch.bfloat16)
        hf.eval()
        print(f"{fmt} experts: {load_average()}", flush=True)
        with Engine.from_pretrained(ours, engine_config(args)) as engine:
            compare(engine, hf, args, label=f"{fmt} experts, ")
        del hf


if __name__ == "__main__":
    main()
