"""Regenerate tests/data/demo_trace.npz: the demo model's decode routing on held-out text.

The held-out standard-library files (demo/corpus.py's split, never trained on) are cut into
`--windows` windows of `--tokens` tokens from spread-out places; each window is decoded token
by token through the model's decode path (KV cache, one token per step, the `resident`
target), feeding the text's own next token instead of a sampled one, so the routing is the
model's on real text rather than on its own greedy loops. Every decode call's router choice
is recorded (planning/trace.py).

Run: python scripts/make_demo_trace.py [-o tests/data/demo_trace.npz]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybridmoe.demo import demo_checkpoint_dir
from hybridmoe.demo.corpus import encode_files, split_corpus
from hybridmoe.engine import Engine, EngineConfig
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.planning.trace import record_routes

OUT = Path(__file__).parents[1] / "tests" / "data" / "demo_trace.npz"


def teacher_forced_decode(engine: Engine, window: list[int]) -> None:
    """Prefill window[0], then decode window[1:] one token per step."""
    model = engine.model
    cache = KVCache(model.cfg, 1, len(window) + 1, model.dtype)
    model.forward(torch.tensor([window[:1]]), model.make_batch(torch.tensor([[0]]), [0], cache))
    for pos, token in enumerate(window[1:], start=1):
        batch = model.make_batch(torch.tensor([[pos]]), [0], cache, is_decode=True)
        model.forward(torch.tensor([[token]]), batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=OUT)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=500, help="per window (<= 511)")
    args = parser.parse_args()
    with Engine.from_pretrained(demo_checkpoint_dir(), EngineConfig(dtype="float32")) as engine:
        ids = encode_files(engine.require_tokenizer().backend, split_corpus().held_out)
        stride = len(ids) // args.windows
        chunks = [ids[i * stride : i * stride + args.tokens] for i in range(args.windows)]
        cfg = engine.model.cfg
        with torch.inference_mode(), record_routes(engine.model.moe_layers, cfg.num_experts) as rec:
            for chunk in chunks:
                teacher_forced_decode(engine, chunk)
        meta = {
            "model": demo_checkpoint_dir().name,
            "decode_target": "resident",
            "top_k": cfg.top_k,
        }
        meta["text"] = (
            f"held-out stdlib, {args.windows} windows x {args.tokens} tokens, teacher-forced"
        )
        trace = rec.trace(meta)
    trace.save(args.output)
    size_kb = args.output.stat().st_size / 1024
    print(f"{args.output}: {trace.num_rows} rows x {trace.num_layers} layers, {size_kb:.0f} KB")


if __name__ == "__main__":
    main()
