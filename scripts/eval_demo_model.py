"""How well the demo model predicts held-out standard library source, and what it writes.

Prints the held-out perplexity of the model (run by our engine) and of a unigram baseline
(token frequencies of the training split, add-one smoothed) on the same tokens, their ratio
(target: <= 1/3), and greedy samples.

Run: python scripts/eval_demo_model.py [--model DIR] [--held-out-tokens N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridmoe.demo import demo_checkpoint_dir
from hybridmoe.demo.corpus import encode_files, split_corpus
from hybridmoe.demo.perplexity import model_perplexity, targets, unigram_perplexity
from hybridmoe.engine import Engine, EngineConfig, SamplingParams

PROMPTS = ("def fibonacci(n):", "The os module", "class Stack:", "import ")
TARGET_RATIO = 1 / 3
MAX_WINDOW = 512


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=demo_checkpoint_dir())
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--held-out-tokens", type=int, default=None, help="default: all")
    parser.add_argument("--max-tokens", type=int, default=48, help="per greedy sample")
    return parser.parse_args()


def perplexities(engine: Engine, held_out_tokens: int | None) -> None:
    backend = engine.require_tokenizer().backend
    split = split_corpus()
    train_ids = encode_files(backend, split.train)
    held_ids = encode_files(backend, split.held_out)[:held_out_tokens]
    window = min(engine.model.cfg.max_position_embeddings, MAX_WINDOW)
    scored = targets(held_ids, window)
    print(f"held out: {len(split.held_out)} files, {len(scored):,} tokens scored")
    print(f"training split (unigram fit): {len(split.train)} files, {len(train_ids):,} tokens")
    model_ppl = model_perplexity(engine.model.logits, held_ids, window, progress=True)
    unigram_ppl = unigram_perplexity(train_ids, scored, engine.model.cfg.vocab_size)
    ratio = model_ppl / unigram_ppl
    verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
    print(f"perplexity: model {model_ppl:.2f}, unigram {unigram_ppl:.2f}, ratio {ratio:.3f}")
    print(f"({verdict} the target ratio <= {TARGET_RATIO:.3f})")


def samples(engine: Engine, max_tokens: int) -> None:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for prompt, completion in zip(PROMPTS, engine.generate(list(PROMPTS), greedy), strict=True):
        print(f"\n--- greedy, {max_tokens} tokens: {prompt!r}\n{prompt}{completion.text}")


def main() -> None:
    args = parse_args()
    config = EngineConfig(dtype="float32", threads=args.threads)
    with Engine.from_pretrained(args.model, config) as engine:
        perplexities(engine, args.held_out_tokens)
        samples(engine, args.max_tokens)


if __name__ == "__main__":
    main()
