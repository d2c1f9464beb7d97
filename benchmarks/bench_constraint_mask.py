"""The cost of grammar-constrained decoding per token, on the demo checkpoint: the mask alone
(llguidance's bitmask -> a bool [V] mask -> masked logits), and whole greedy decode steps of an
unconstrained, a json_schema-constrained and a logprobs request, measured side by side.

    python benchmarks/bench_constraint_mask.py [--repeats 5] [--vocab 151936]

`--vocab N` also times the mask over a synthetic N-token vocabulary (the demo's 4096 tokens plus
concatenations of them, as BPE merges make), since the demo's vocabulary is small.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from hybridmoe.demo import demo_checkpoint_dir
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.constraints import Grammar, GrammarCompiler, mask_logits

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as JSON:"


def mask_cost_us(compiler: GrammarCompiler, tokens: list[int], vocab: int) -> tuple[float, float]:
    """Median microseconds per token of allowed() and of mask_logits, along `tokens`."""
    constraint = compiler.constraint(Grammar.json_schema(SCHEMA))
    logits = torch.randn(vocab)
    allowed_s, masked_s = [], []
    for token in tokens:
        start = time.perf_counter()
        allowed = constraint.allowed()
        middle = time.perf_counter()
        mask_logits(logits, allowed)
        allowed_s.append(middle - start)
        masked_s.append(time.perf_counter() - middle)
        constraint.advance(token)
    return statistics.median(allowed_s) * 1e6, statistics.median(masked_s) * 1e6


def synthetic_compiler(engine: Engine, vocab: int) -> GrammarCompiler:
    base = list(engine.tokenizer.token_bytes(engine.model.cfg.vocab_size))
    rng = random.Random(0)
    seen = set(base)
    while len(base) < vocab:
        merged = rng.choice(base[3:4096]) + rng.choice(base[3:4096])
        if merged not in seen:
            seen.add(merged)
            base.append(merged)
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return GrammarCompiler(base, sorted(engine.eos_ids), [0, 1, 2], encode)


def decode_ms_per_token(engine: Engine, params: SamplingParams) -> float:
    start = time.perf_counter()
    (completion,) = engine.generate([PROMPT], params)
    return (time.perf_counter() - start) * 1e3 / len(completion.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    engine = Engine.from_pretrained(demo_checkpoint_dir(), EngineConfig(dtype="float32"))
    grammar = Grammar.json_schema(SCHEMA)
    (constrained,) = engine.generate([PROMPT], SamplingParams(max_tokens=64, grammar=grammar))
    tokens = constrained.token_ids
    print(f"constrained output ({len(tokens)} tokens): {constrained.text!r}")
    vocab = engine.model.cfg.vocab_size
    allowed_us, masked_us = mask_cost_us(engine.grammars, tokens, vocab)
    print(
        f"mask, demo vocab {vocab}: allowed() {allowed_us:.1f} us, mask_logits {masked_us:.1f} us"
    )
    if args.vocab:
        compiler = synthetic_compiler(engine, args.vocab)
        allowed_us, masked_us = mask_cost_us(compiler, tokens, args.vocab)
        print(
            f"mask, synthetic vocab {args.vocab}: allowed() {allowed_us:.1f} us, "
            f"mask_logits {masked_us:.1f} us"
        )
    n = len(tokens)
    runs = {
        "plain": SamplingParams(max_tokens=n, ignore_eos=True),
        "json_schema": SamplingParams(max_tokens=n, grammar=grammar),
        "logprobs=5": SamplingParams(max_tokens=n, ignore_eos=True, logprobs=5),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so load changes hit every row alike
        for name, params in runs.items():
            times[name].append(decode_ms_per_token(engine, params))
    base = statistics.median(times["plain"])
    for name, samples in times.items():
        ms = statistics.median(samples)
        print(f"{name:12s} {ms:7.3f} ms/token  x{ms / base:.3f}")


if __name__ == "__main__":
    main()
