"""Engine end to end on the demo checkpoint: batching, streaming, stopping, context limits."""

from __future__ import annotations

import pytest

from hybridmoe.engine import Engine, EngineConfig, SamplingParams

# Different lengths, so batched decode steps mix rows at different positions.
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\nx = np.zeros((3, 4))\nfor row in x:\n    print(",
]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(demo_checkpoint) -> Engine:
    return Engine.from_pretrained(demo_checkpoint, EngineConfig(dtype="float32"))


def test_batch_equals_each_prompt_alone(engine):
    batched = engine.generate(PROMPTS, GREEDY)
    for prompt, together in zip(PROMPTS, batched, strict=True):
        (alone,) = engine.generate([prompt], GREEDY)
        assert together.token_ids == alone.token_ids, prompt
        assert together.text == alone.text, prompt


def test_seeded_sampling_in_a_batch_equals_alone(engine):
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    batched = engine.generate(PROMPTS, params)
    for prompt, together in zip(PROMPTS, batched, strict=True):
        (alone,) = engine.generate([prompt], params)
        assert together.token_ids == alone.token_ids, prompt


def test_generate_ids_matches_generate(engine):
    (completion,) = engine.generate([PROMPTS[0]], GREEDY)
    assert engine.generate_ids([completion.prompt_ids], GREEDY) == [completion.token_ids]


def test_stream_pieces_join_to_generated_text(engine):
    for prompt in PROMPTS:
        pieces = list(engine.stream(prompt, GREEDY))
        (completion,) = engine.generate([prompt], GREEDY)
        assert "".join(pieces) == completion.text
        assert all(pieces), "stream yields no empty pieces"


def test_max_tokens_ends_with_length(engine):
    for completion in engine.generate(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True)):
        assert len(completion.token_ids) == 5
        assert completion.finish_reason == "length"


def test_stop_string_cuts_text(engine):
    (full,) = engine.generate([PROMPTS[0]], GREEDY)
    stop = full.text[len(full.text) // 2 :][:3]  # occurs in the unstopped text by construction
    params = SamplingParams(max_tokens=GREEDY.max_tokens, stop=stop, ignore_eos=True)
    (stopped,) = engine.generate([PROMPTS[0]], params)
    assert stopped.text == full.text[: full.text.index(stop)]
    assert stopped.finish_reason == "stop"
    assert len(stopped.token_ids) < len(full.token_ids)
    assert "".join(engine.stream(PROMPTS[0], params)) == stopped.text


def test_eos_stops_generation(engine, monkeypatch):
    (full,) = engine.generate([PROMPTS[0]], GREEDY)
    first = full.token_ids[0]
    eos_engine = engine
    monkeypatch.setattr(eos_engine, "eos_ids", engine.eos_ids | {first})

    (stopped,) = eos_engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12))
    assert stopped.token_ids == [first]  # the EOS token is reported, its text is not
    assert stopped.finish_reason == "stop"
    assert stopped.text == ""

    (ignored,) = eos_engine.generate([PROMPTS[0]], GREEDY)
    assert ignored.token_ids == full.token_ids
    assert ignored.finish_reason == "length"


def test_stop_token_ids_end_generation_as_eos_does(engine):
    (full,) = engine.generate([PROMPTS[0]], GREEDY)
    third = full.token_ids[2]
    cut = full.token_ids.index(third) + 1  # the first occurrence ends it
    assert not engine.eos_ids & set(full.token_ids[:cut])  # nothing else ends it earlier
    params = SamplingParams(max_tokens=GREEDY.max_tokens, stop_token_ids=[third])
    (stopped,) = engine.generate([PROMPTS[0]], params)
    assert stopped.token_ids == full.token_ids[:cut] and stopped.finish_reason == "stop"
    assert stopped.text == engine.tokenizer.decode(full.token_ids[: cut - 1])  # not its text
    ignored = SamplingParams(max_tokens=GREEDY.max_tokens, stop_token_ids=[third], ignore_eos=True)
    assert engine.generate([PROMPTS[0]], ignored)[0].token_ids == full.token_ids


def test_demo_eos_comes_from_its_config(engine):
    eos = engine.tokenizer.backend.token_to_id("<|im_end|>")
    assert eos in engine.eos_ids


def test_prompt_longer_than_context_is_refused(engine):
    window = engine.model.cfg.max_position_embeddings
    prompt = " ".join(["token"] * (window + 10))
    assert len(engine.encode(prompt)) > window
    with pytest.raises(ValueError, match=f"context window is {window}"):
        engine.generate([prompt], GREEDY)
    with pytest.raises(ValueError, match="context window"):
        engine.generate_ids([[1] * window], GREEDY)


def test_generation_stops_at_context_window(demo_variant):
    small = Engine.from_pretrained(demo_variant({"max_position_embeddings": 16}))
    prompt_ids = small.encode(PROMPTS[0])
    (completion,) = small.generate([PROMPTS[0]], GREEDY)
    assert len(prompt_ids) + len(completion.token_ids) == 16
    assert completion.finish_reason == "length"


def test_prompts_beyond_max_batch_wait_for_a_row(demo_checkpoint):
    config = EngineConfig(dtype="float32", max_batch=2)
    with Engine.from_pretrained(demo_checkpoint, config) as small:
        prompts = [*PROMPTS, PROMPTS[0]]  # four prompts, two KV-cache rows
        queued = small.generate(prompts, GREEDY)
        assert small.stats.requests_served == 4
        for prompt, completion in zip(prompts, queued, strict=True):
            (alone,) = small.generate([prompt], GREEDY)
            assert completion.token_ids == alone.token_ids, prompt


def test_stats_count_the_last_call_and_the_scheduler_counts_since_start(engine):
    before = engine.scheduler.stats()
    engine.generate(PROMPTS[:2], SamplingParams(max_tokens=5, ignore_eos=True))
    (completion,) = engine.generate([PROMPTS[2]], GREEDY)
    stats, since_start = engine.stats, engine.scheduler.stats().since(before)
    assert (stats.prompt_tokens, stats.decode_tokens) == (len(completion.prompt_ids), 11)
    assert (stats.requests_served, stats.completion_tokens, stats.decode_steps) == (1, 12, 11)
    assert since_start.requests_served == 3 and since_start.completion_tokens == 2 * 5 + 12
    # the cpu target (`auto` on the cpu device): every route computed on the CPU
    assert stats.experts.cpu_routes == stats.experts.routes > 0 and stats.experts.hits == 0
    assert "prompt tokens" in stats.summary() and "decode:" in stats.summary()


def test_a_stream_left_early_frees_its_row(engine):
    pieces = engine.stream(PROMPTS[0], GREEDY)
    next(pieces)
    pieces.close()
    (completion,) = engine.generate([PROMPTS[0]], GREEDY)
    assert "".join(engine.stream(PROMPTS[0], GREEDY)) == completion.text
    assert engine.scheduler.idle


def test_generate_refuses_while_the_scheduler_runs_on_a_thread(demo_checkpoint):
    with Engine.from_pretrained(demo_checkpoint, EngineConfig(dtype="float32")) as served:
        served.scheduler.start()
        with pytest.raises(RuntimeError, match="another thread"):
            served.generate([PROMPTS[0]], GREEDY)


@pytest.mark.parametrize("dtype, attention_kernel", [("bfloat16", "auto"), ("float32", "on")])
def test_a_prompt_gets_the_same_logits_alone_and_batched(demo_checkpoint, dtype, attention_kernel):
    """Batch invariance to the bit on the `cpu` decode target (the default without a GPU):
    each prompt's every logprob in a batch of prompts of different lengths equals its logprobs
    alone. Neither the decode attention kernel (each row over its own keys: kernels/
    numba_attention.py; bfloat16 takes it by default, float32 where asked: its default is
    SDPA, whose batch pads the keys) nor the experts' tiles (one summation order whatever
    tokens share an expert: kernels/numba_simd.py) depend on the rows beside a sequence. The
    prefix cache is off: a prompt prefilled after a cached prefix differs in float32's last
    bits (README), which is not the batch's doing."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    config = EngineConfig(dtype=dtype, attention_kernel=attention_kernel, prefix_cache_tokens=0)
    with Engine.from_pretrained(demo_checkpoint, config) as engine:
        batched = engine.generate(PROMPTS, params)
        for prompt, together in zip(PROMPTS, batched, strict=True):
            (alone,) = engine.generate([prompt], params)
            assert together.logprobs == alone.logprobs, prompt


def test_warm_up_keeps_the_last_requests_stats_and_restarts_the_expert_counters(engine):
    (completion,) = engine.generate([PROMPTS[0]], GREEDY)
    last = engine.stats
    before = engine.scheduler.stats()
    engine.warm_up()
    assert engine.stats is last and last.completion_tokens == len(completion.token_ids)
    warm = engine.scheduler.stats().since(before)  # one request of 2 tokens ran
    assert (warm.requests_served, warm.completion_tokens, warm.decode_steps) == (1, 2, 1)
    assert engine.moe_runtime.cpu_executor.stats == {}  # restarted after the warm-up


@pytest.mark.parametrize("max_seq_len", [2, 3])
def test_warm_up_fits_a_short_context(demo_checkpoint, max_seq_len):
    config = EngineConfig(dtype="float32", max_seq_len=max_seq_len, prefix_cache_tokens=0)
    with Engine.from_pretrained(demo_checkpoint, config) as short:
        before = short.scheduler.stats()
        short.warm_up()  # a prompt of max_seq_len - 1 ids, cut at the context window
        assert short.scheduler.stats().since(before).requests_served == 1
