"""Two engines in one process, A and B, differing by module settings made while each loads;
greedy decode rounds alternating between them, their time a token compared pair by pair.

    python benchmarks/bench_engine_ab.py --model MODEL \\
        --b hybridmoe.kernels.numba_dense.MIN_PARALLEL_BYTES=262144 [--a MODULE.ATTR=VALUE ...] \\
        [--threads 2] [--tokens 100] [--rounds 12] [--batch 1] [--dtype bfloat16]

Why in one process: on a shared or virtualised host the same build runs ±15-25 % apart from one
process to the next (the DRAM's state, where the pages landed, the neighbours), which hides a
change of a few percent; two engines in one process, their rounds alternating (A B, then B A),
see the same state. A round is one greedy request (a 5-token prompt, --tokens tokens: its
prefill in its time); the figure is the median of the pairs' ratios (B's time / A's), with
their range; both engines must decode the same tokens (checked: a setting that changes the result is
refused, unless --allow-different).

A setting is MODULE.ATTR=VALUE (VALUE a Python literal), set before the engine loads and put
back after: it changes what the engine decides at load and when it builds its plans (a
threshold, a switch read by a constructor). A value that numba compiles into a cached kernel
(a constant a jitted function reads as a global) is frozen at its first compilation: it needs
two processes with separate caches, not this.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

PROMPT_IDS = [1, 2, 3, 4]


@dataclass(frozen=True)
class Setting:
    module: str
    attr: str
    value: object

    @classmethod
    def parse(cls, spec: str) -> Setting:
        """MODULE.ATTR=VALUE; SystemExit naming the spec where it is not one."""
        target, sep, literal = spec.partition("=")
        module, dot, attr = target.rpartition(".")
        if not (sep and dot and module and attr):
            raise SystemExit(f"bench_engine_ab: setting {spec!r} is not MODULE.ATTR=VALUE")
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            raise SystemExit(
                f"bench_engine_ab: {spec!r}: {literal!r} is not a Python literal"
            ) from None
        return cls(module, attr, value)

    def owner(self):
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:
            raise SystemExit(f"bench_engine_ab: setting {self}: {exc}") from None
        if not hasattr(module, self.attr):
            raise SystemExit(f"bench_engine_ab: {self.module} has no attribute {self.attr!r}")
        return module

    def __str__(self) -> str:
        return f"{self.module}.{self.attr}={self.value!r}"


@contextlib.contextmanager
def applied(settings: list[Setting]) -> Iterator[None]:
    """The settings in force inside the block; each attribute put back after."""
    saved = []
    try:
        for setting in settings:
            module = setting.owner()
            saved.append((module, setting.attr, getattr(module, setting.attr)))
            setattr(module, setting.attr, setting.value)
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory or GGUF file")
    parser.add_argument("--a", action="append", default=[], metavar="MODULE.ATTR=VALUE")
    parser.add_argument("--b", action="append", default=[], metavar="MODULE.ATTR=VALUE")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=100, help="decoded a round")
    parser.add_argument("--rounds", type=int, default=12, help="per engine")
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--allow-different", action="store_true", help="tokens may differ")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.rounds < 1 or args.batch < 1 or args.threads < 1:
        parser.error("--tokens must be >= 2, --rounds, --batch and --threads >= 1")
    args.a = [Setting.parse(spec) for spec in args.a]
    args.b = [Setting.parse(spec) for spec in args.b]
    return args


def load(args: argparse.Namespace, settings: list[Setting]):
    import torch

    from hybridmoe.engine import Engine, EngineConfig

    torch.set_num_threads(args.threads)
    config = EngineConfig(
        dtype=args.dtype, threads=args.threads, max_batch=args.batch, prefix_cache_tokens=0
    )
    with applied(settings):
        return Engine.from_pretrained(Path(args.model), config)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> dict:
    """Runs the comparison and prints it; returns {"a": [ms a token ...], "b": [...], "ratios":
    [...], "same_tokens": bool}."""
    args = parse_args(argv)
    from hybridmoe.engine import SamplingParams

    engines = {"a": load(args, args.a), "b": load(args, args.b)}
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompts = [[*PROMPT_IDS, 5 + i] for i in range(args.batch)]
    tokens = {name: engine.generate_ids(prompts, params) for name, engine in engines.items()}
    same = tokens["a"] == tokens["b"]
    if not same and not args.allow_different:
        raise SystemExit("bench_engine_ab: A and B decode different tokens (--allow-different)")
    print(f"load average before: {load_average()}")
    times: dict[str, list[float]] = {"a": [], "b": []}
    for round_ in tqdm(range(args.rounds), desc="rounds", unit="round", file=sys.stderr):
        for name in ("a", "b") if round_ % 2 == 0 else ("b", "a"):
            start = time.perf_counter()
            engines[name].generate_ids(prompts, params)
            times[name].append((time.perf_counter() - start) * 1e3 / args.tokens)
    print(f"load average after: {load_average()}")
    ratios = sorted(b / a for a, b in zip(times["a"], times["b"], strict=True))
    for name, settings in (("A", args.a), ("B", args.b)):
        shown = ", ".join(map(str, settings)) or "the defaults"
        print(f"{name}: {shown}: {statistics.median(times[name.lower()]):.2f} ms a token (median)")
    print(
        f"B / A, the time a token: {statistics.median(ratios):.3f} (median of {len(ratios)} "
        f"pairs, {ratios[0]:.3f}-{ratios[-1]:.3f}); tokens identical: {same}"
    )
    for engine in engines.values():
        engine.close()
    return {**times, "ratios": ratios, "same_tokens": same}


if __name__ == "__main__":
    main()
