"""The planning commands: `hybridmoe trace` (record routing), `plan` (predict decode tok/s from a
config) and `bench-hw` (measure the hardware profile `plan` reads).

cli.py owns the parser of `trace` (it takes every engine and sampling flag `generate` takes)
and registers the parsers of `plan` and `bench-hw` from here (`add_parsers`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridmoe.engine import Engine, SamplingParams
from hybridmoe.planning.trace import RoutingTrace, record_routes


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line of a UTF-8 text file (blank lines skipped); ValueError naming the
    file when it holds none."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompt (one per line) in the file")
    return prompts


def record_trace(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, meta: dict | None = None
) -> tuple[RoutingTrace, list[list[int]]]:
    """The routing trace of decoding `prompts` (token ids) with `params`, one prompt after
    another, and the tokens generated (the same as without recording)."""
    cfg = engine.model.cfg
    with record_routes(engine.model.moe_layers, cfg.num_experts) as recorder:
        tokens = engine.generate_ids(prompts, params)
    target = engine.config.offload.decode_target
    info = {"decode_target": target, "top_k": cfg.top_k, "prompts": len(prompts)}
    return recorder.trace({**info, **(meta or {})}), tokens


def run_trace(engine: Engine, args: argparse.Namespace, params: SamplingParams) -> None:
    prompts = [engine.encode(text) for text in read_prompts(args.prompts)]
    meta = {"model": Path(engine_model_name(args)).name}
    trace, tokens = record_trace(engine, prompts, params, meta)
    trace.save(args.output)
    decoded = sum(len(t) for t in tokens)
    print(
        f"{args.output}: {trace.num_rows} decode steps x {trace.num_layers} MoE layers x "
        f"top-{trace.top_k} of {trace.num_experts} experts ({decoded} tokens generated)",
        file=sys.stderr,
    )


def engine_model_name(args: argparse.Namespace) -> str:
    return args.model or "demo"


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """The parsers of `plan` and `bench-hw` (COMMANDS runs them)."""


COMMANDS: dict = {}
