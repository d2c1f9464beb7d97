"""Per-token logprobs: the log-softmax of the model's own logits for the same tokens."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.logprobs import token_logprobs

PROMPTS = ["def fibonacci(n):", "The capital of France is"]


@pytest.fixture(scope="module")
def engine(demo_checkpoint) -> Engine:
    return Engine.from_pretrained(demo_checkpoint, EngineConfig(dtype="float32"))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_log_softmax_of_the_model_logits(engine, temperature):
    params = SamplingParams(
        max_tokens=8, temperature=temperature, seed=5, ignore_eos=True, logprobs=3
    )
    for completion in engine.generate(PROMPTS, params):
        ids = completion.prompt_ids + completion.token_ids
        logits = engine.model.logits(ids[:-1])[len(completion.prompt_ids) - 1 :]  # [N, V]
        expected = torch.log_softmax(logits, dim=-1)  # [N, V]: raw, before temperature
        assert len(completion.logprobs) == len(completion.token_ids)
        for step, (entry, token) in enumerate(
            zip(completion.logprobs, completion.token_ids, strict=True)
        ):
            assert entry.token_id == token
            diff = abs(entry.logprob - float(expected[step, token]))
            assert diff < 1e-4, f"step {step}: |logprob - reference| = {diff}"
            top_values, top_ids = expected[step].topk(3)
            assert [i for i, _ in entry.top] == top_ids.tolist()
            assert (
                max(abs(a - b) for (_, a), b in zip(entry.top, top_values.tolist(), strict=True))
                < 1e-4
            )


def test_logprobs_do_not_change_the_tokens(engine):
    plain = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    with_logprobs = engine.generate(
        PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
    )
    assert [c.token_ids for c in plain] == [c.token_ids for c in with_logprobs]
    assert all(c.logprobs is None for c in plain)
    assert all(entry.top == () for c in with_logprobs for entry in c.logprobs)


def test_greedy_token_is_the_most_likely():
    logits = torch.tensor([0.5, 2.0, 2.0, -1.0])
    entry = token_logprobs(logits, 1, top_n=2)
    assert entry.top[0][0] == 1 and entry.top[1][0] == 2  # ties: lower id first
    assert entry.logprob == pytest.approx(float(torch.log_softmax(logits, 0)[1]))


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)
