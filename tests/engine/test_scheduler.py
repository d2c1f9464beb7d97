"""Scheduler on the demo model, driven step by step in-process: requests join and leave between
steps, batched tokens equal tokens alone, cancelled and failing requests free their rows."""

from __future__ import annotations

import threading

import pytest

from hybridmoe.engine import Engine, EngineConfig, SamplingParams, steps
from hybridmoe.engine.scheduler import RequestOutput, Scheduler, SchedulerClosed

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\nx = np.zeros((3, 4))\nfor row in x:\n    print(",
]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
MAX_STEPS = 1000  # only so a scheduler bug fails the test instead of looping forever


class Collector:
    """The outputs one request received, in order."""

    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.done = threading.Event()

    def __call__(self, output: RequestOutput) -> None:
        self.outputs.append(output)
        if output.finished:
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def last(self) -> RequestOutput:
        return self.outputs[-1]


@pytest.fixture(scope="module")
def engine(demo_checkpoint) -> Engine:
    return Engine.from_pretrained(demo_checkpoint, EngineConfig(dtype="float32", max_batch=4))


def new_scheduler(engine: Engine, max_seq_len: int = 256) -> Scheduler:
    """A scheduler of its own (and KV cache) over the engine's model."""
    return Scheduler(engine.model, engine.moe_runtime, engine.config.max_batch, max_seq_len)


@pytest.fixture
def scheduler(engine) -> Scheduler:
    scheduler = new_scheduler(engine)
    yield scheduler
    scheduler.close()


def sequence(engine: Engine, scheduler: Scheduler, prompt: str | list[int], params: SamplingParams):
    ids = engine.encode(prompt) if isinstance(prompt, str) else prompt
    return engine.new_sequence(ids, params, with_text=True, max_len=scheduler.max_seq_len)


def submit(engine: Engine, scheduler: Scheduler, prompt: str, params: SamplingParams = GREEDY):
    collector = Collector()
    request = scheduler.submit(sequence(engine, scheduler, prompt, params), collector)
    return request, collector


def run_until_idle(scheduler: Scheduler) -> None:
    for _ in range(MAX_STEPS):
        if not scheduler.running and not scheduler.waiting:
            return
        scheduler.step()
    pytest.fail(f"scheduler still busy after {MAX_STEPS} steps")


def alone(
    engine: Engine, scheduler: Scheduler, prompt: str, params: SamplingParams = GREEDY
) -> Collector:
    _, collector = submit(engine, scheduler, prompt, params)
    run_until_idle(scheduler)
    return collector


def test_batched_equals_alone_and_engine_generate(engine, scheduler):
    collectors = [submit(engine, scheduler, p)[1] for p in PROMPTS]
    run_until_idle(scheduler)
    for prompt, together in zip(PROMPTS, collectors, strict=True):
        (reference,) = engine.generate([prompt], GREEDY)
        assert together.text == alone(engine, scheduler, prompt).text == reference.text, prompt
        assert (together.last.finish_reason, together.last.completion_tokens) == ("length", 12)


def test_seeded_sampling_batched_equals_alone(engine, scheduler):
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    collectors = [submit(engine, scheduler, p, params)[1] for p in PROMPTS]
    run_until_idle(scheduler)
    for prompt, together in zip(PROMPTS, collectors, strict=True):
        assert together.text == alone(engine, scheduler, prompt, params).text, prompt


def test_requests_join_and_leave_between_steps(engine, scheduler):
    long = SamplingParams(max_tokens=20, ignore_eos=True)
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    _, first = submit(engine, scheduler, PROMPTS[2], long)
    for _ in range(3):
        scheduler.step()
    _, joiner = submit(engine, scheduler, PROMPTS[0], short)
    scheduler.step()
    assert len(scheduler.running) == 2, "the second request joined the running batch"
    for _ in range(3):
        scheduler.step()
    assert joiner.done.is_set() and not first.done.is_set(), "the short one left first"
    assert len(scheduler.running) == 1
    run_until_idle(scheduler)
    assert first.text == alone(engine, scheduler, PROMPTS[2], long).text
    assert joiner.text == alone(engine, scheduler, PROMPTS[0], short).text
    assert [o.finish_reason for o in (first.last, joiner.last)] == ["length", "length"]
    assert (first.last.completion_tokens, joiner.last.completion_tokens) == (20, 4)


def test_reused_row_ignores_its_previous_occupant(engine, scheduler):
    # A long sequence fills row 0 far beyond the short prompt that takes the row next.
    alone(engine, scheduler, PROMPTS[2], SamplingParams(max_tokens=40, ignore_eos=True))
    reused = alone(engine, scheduler, PROMPTS[0])
    fresh = new_scheduler(engine)
    _, clean = submit(engine, fresh, PROMPTS[0])
    run_until_idle(fresh)
    assert reused.text == clean.text


def test_cancel_frees_the_row_before_the_next_step(engine, scheduler):
    request, collector = submit(engine, scheduler, PROMPTS[0], SamplingParams(max_tokens=50))
    scheduler.step()
    assert len(scheduler.running) == 1
    request.cancel()
    scheduler.step()
    assert not scheduler.running and sorted(scheduler.free_rows) == [0, 1, 2, 3]
    assert not collector.done.is_set()
    assert scheduler.stats().requests_cancelled == 1


def test_more_requests_than_rows_wait_their_turn(engine, scheduler):
    collectors = [submit(engine, scheduler, PROMPTS[i % 3])[1] for i in range(6)]
    scheduler.step()
    assert len(scheduler.running) == 4 and len(scheduler.waiting) == 2
    run_until_idle(scheduler)
    assert all(c.last.finish_reason == "length" for c in collectors)
    assert collectors[4].text == collectors[1].text  # same prompt, same greedy tokens


def test_failing_prefill_fails_that_request_only(engine, scheduler, monkeypatch):
    bad_ids = engine.encode(PROMPTS[1])
    real_prefill = steps.prefill

    def prefill(model, seq, row, cache, cached_tokens=0):
        if seq.prompt_ids == bad_ids:
            raise RuntimeError("injected prefill failure")
        return real_prefill(model, seq, row, cache, cached_tokens)

    monkeypatch.setattr(steps, "prefill", prefill)
    _, good = submit(engine, scheduler, PROMPTS[0])
    _, bad = submit(engine, scheduler, PROMPTS[1])
    run_until_idle(scheduler)
    assert "injected" in str(bad.last.error) and bad.last.finished
    assert good.last.finish_reason == "length" and good.last.error is None
    stats = scheduler.stats()
    assert (stats.requests_failed, stats.requests_served) == (1, 1)
    assert len(scheduler.free_rows) == scheduler.max_batch


def test_failing_decode_step_fails_the_batch_and_scheduling_goes_on(engine, scheduler, monkeypatch):
    def decode(*args):
        raise RuntimeError("injected decode failure")

    _, first = submit(engine, scheduler, PROMPTS[0])
    scheduler.step()
    with monkeypatch.context() as patch:
        patch.setattr(steps, "decode", decode)
        scheduler.step()
    assert first.last.error is not None and not scheduler.running
    assert alone(engine, scheduler, PROMPTS[0]).last.finish_reason == "length"


def test_callback_that_raises_drops_its_request(engine, scheduler):
    def broken(output: RequestOutput) -> None:
        raise RuntimeError("consumer gone")

    scheduler.submit(sequence(engine, scheduler, PROMPTS[0], GREEDY), broken)
    scheduler.step()
    scheduler.step()
    assert not scheduler.running


def test_background_thread_serves_submissions_from_many_threads(engine):
    scheduler = new_scheduler(engine)
    scheduler.start()
    collectors = [Collector() for _ in PROMPTS]

    def client(prompt: str, collector: Collector) -> None:
        scheduler.submit(sequence(engine, scheduler, prompt, GREEDY), collector)

    threads = [
        threading.Thread(target=client, args=pair) for pair in zip(PROMPTS, collectors, strict=True)
    ]
    for thread in threads:
        thread.start()
    for collector in collectors:
        assert collector.done.wait(timeout=120), "a request never finished"
    scheduler.close()
    assert not scheduler.alive
    for prompt, collector in zip(PROMPTS, collectors, strict=True):
        assert collector.text == engine.generate([prompt], GREEDY)[0].text
    with pytest.raises(SchedulerClosed):
        scheduler.submit(sequence(engine, scheduler, PROMPTS[0], GREEDY), Collector())


def test_close_fails_requests_still_in_flight(engine):
    scheduler = new_scheduler(engine)
    _, running = submit(engine, scheduler, PROMPTS[0])
    scheduler.step()
    _, waiting = submit(engine, scheduler, PROMPTS[1])
    scheduler.close()
    for collector in (running, waiting):
        assert isinstance(collector.last.error, SchedulerClosed)


def test_context_limits(engine, scheduler):
    with pytest.raises(ValueError, match="max_seq_len"):
        new_scheduler(engine, max_seq_len=engine.model.cfg.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="context window is 256"):
        sequence(engine, scheduler, [1] * 256, GREEDY)
    too_long = engine.new_sequence([1, 2, 3], GREEDY, with_text=True, max_len=257)
    with pytest.raises(ValueError, match="the KV cache holds 256"):
        scheduler.submit(too_long, Collector())
    small = new_scheduler(engine, max_seq_len=32)
    ids = engine.encode(PROMPTS[0])
    collector = Collector()
    long = SamplingParams(max_tokens=500, ignore_eos=True)
    small.submit(sequence(engine, small, ids, long), collector)
    run_until_idle(small)
    assert collector.last.finish_reason == "length"
    assert len(ids) + collector.last.completion_tokens == 32
