"""Warming up before /health says ok: one tiny request through the engine, so the CPU expert
kernels of the configured format are compiled (or loaded from the on-disk cache) and every
code path of a prefill and a decode step has run once before the first client waits on it."""

from __future__ import annotations

from hybridmoe.engine import Engine
from hybridmoe.engine.stats import GenerationStats


def warm_up(engine: Engine) -> GenerationStats:
    """Run the warm-up request on this thread (the one that will run the scheduler: see
    Scheduler.run) and return the scheduler's counters after it, the baseline the server's
    stats and metrics count from, so the warm-up is not counted as a request served. The
    expert-cache counters restart; the tokenizer's longest token (limits.check_prompt_chars)
    is looked up and the grammar compiler of structured output built. Raises SchedulerClosed
    if the scheduler closes meanwhile."""
    engine.warm_up()
    if engine.tokenizer is not None:
        _ = engine.tokenizer.longest_token_chars  # computed once, here, not by a first request
        _ = engine.grammars  # the grammar library's vocabulary setup: seconds on a 152k one
    return engine.scheduler.stats()
