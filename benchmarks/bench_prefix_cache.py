"""Time to first token of each turn of a multi-turn chat, with the prefix cache and without it,
side by side in one process: what reusing the chat history's KV buys.

    python benchmarks/bench_prefix_cache.py [--model DIR] [--turns 6] [--reply-tokens 24]
                                            [--repeats 3] [--dtype float32] [--threads 2]

Two engines on the same checkpoint (the demo model by default): `--prefix-cache-tokens`
default and 0. The conversation (a long system prompt, then user messages and the model's
greedy replies) is generated once; each turn's prompt is the chat template over the history so
far, so turn k's prompt extends turn k-1's. Per repeat, each engine gets a fresh scheduler (an
empty prefix cache) and is sent the turns in order, one token each (TTFT = the prefill of the
uncached part of the prompt + sampling), the two engines alternating turn by turn. Medians over
the repeats; the ratio is without / with. Exactness: the first token of every turn is compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from hybridmoe.demo import require_demo_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.scheduler import Scheduler

SYSTEM = (
    "You are a meticulous assistant for a team of engineers. Answer in plain words, cite the "
    "file you mean, never invent an API, and keep each answer under five sentences. "
) * 3
USERS = [
    "How do I read a file line by line?",
    "And how do I skip blank lines?",
    "Can I do that lazily for a huge file?",
    "What if the file is compressed with gzip?",
    "How do I count the words too?",
    "Now print the ten most common ones.",
    "Make it a function with a docstring.",
    "Add a test for it.",
]
FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo model")
    parser.add_argument("--turns", type=int, default=6, choices=range(1, len(USERS) + 1))
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def chat_prompts(engine: Engine, turns: int, reply_tokens: int) -> list[list[int]]:
    """Each turn's prompt ids: the template over the system prompt and the history so far."""
    tokenizer, messages, prompts = engine.require_tokenizer(), [], []
    messages.append({"role": "system", "content": SYSTEM})
    reply = SamplingParams(max_tokens=reply_tokens, ignore_eos=True)
    for user in USERS[:turns]:
        messages.append({"role": "user", "content": user})
        ids = engine.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        prompts.append(ids)
        (reply_ids,) = engine.generate_ids([ids], reply)
        messages.append({"role": "assistant", "content": tokenizer.decode(reply_ids)})
    return prompts


def fresh_scheduler(engine: Engine) -> None:
    """A new scheduler (KV cache, empty prefix cache) over the engine's model."""
    old = engine.scheduler
    blocks = engine.config.resolve_prefix_cache_blocks(engine.max_seq_len)
    args = (engine.model, engine.moe_runtime, old.max_batch, old.max_seq_len, blocks)
    old.close()  # drops its caches; the model and runtime are the engine's
    engine.scheduler = Scheduler(*args)


def ttft_s(engine: Engine, prompt: list[int]) -> tuple[float, int, int]:
    """(seconds to the first token, the token, prompt tokens the prefix cache held)."""
    start = time.perf_counter()
    (tokens,) = engine.generate_ids([prompt], FIRST_TOKEN)
    return time.perf_counter() - start, tokens[0], engine.stats.cached_prompt_tokens


def main() -> None:
    args = parse_args()
    directory = args.model or require_demo_checkpoint()
    config = EngineConfig(dtype=args.dtype, threads=args.threads, max_batch=1)
    with_cache = Engine.from_pretrained(directory, config)
    without = Engine.from_pretrained(directory, replace(config, prefix_cache_tokens=0))
    prompts = chat_prompts(without, args.turns, args.reply_tokens)
    ttft_s(with_cache, prompts[0])  # warm-up (its cache is replaced below)
    times = {"with": [[] for _ in prompts], "without": [[] for _ in prompts]}
    cached = [0] * len(prompts)
    for _ in range(args.repeats):
        fresh_scheduler(with_cache)
        for turn, prompt in enumerate(prompts):
            on_s, on_token, cached[turn] = ttft_s(with_cache, prompt)
            off_s, off_token, _ = ttft_s(without, prompt)
            assert on_token == off_token, f"turn {turn + 1}: first tokens differ"
            times["with"][turn].append(on_s)
            times["without"][turn].append(off_s)
    report(prompts, cached, times, args)
    with_cache.close()
    without.close()


def report(prompts, cached, times, args) -> None:
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"load average: {load} on {os.cpu_count()} CPUs")
    print(f"dtype {args.dtype}, threads {args.threads}, medians of {args.repeats} repeats")
    print("turn  prompt  cached  TTFT without (ms)  TTFT with (ms)  ratio")
    for turn, prompt in enumerate(prompts):
        off = statistics.median(times["without"][turn]) * 1e3
        on = statistics.median(times["with"][turn]) * 1e3
        print(
            f"{turn + 1:>4}  {len(prompt):>6}  {cached[turn]:>6}  {off:>17.1f}  {on:>14.1f}  "
            f"{off / on:>5.2f}x"
        )
    last = len(prompts) - 1
    ratio = statistics.median(times["without"][last]) / statistics.median(times["with"][last])
    print(
        f"turn {last + 1}: TTFT without / with the prefix cache = {ratio:.2f}x; first tokens equal"
    )


if __name__ == "__main__":
    main()
