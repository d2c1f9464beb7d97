"""Grammar-constrained decoding on the demo model, which left alone writes Python, not JSON."""

from __future__ import annotations

import json

import pytest
import torch

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.constraints import (
    Grammar,
    GrammarError,
    mask_logits,
    mask_logits_reference,
)

PROMPT = "Describe a person as JSON:"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(demo_checkpoint) -> Engine:
    return Engine.from_pretrained(demo_checkpoint, EngineConfig(dtype="float32"))


def _generate(engine: Engine, grammar: Grammar | None, prompt: str = PROMPT, **kw):
    (completion,) = engine.generate([prompt], SamplingParams(max_tokens=60, grammar=grammar, **kw))
    return completion


def _check_person(value: object) -> None:
    # The schema checked by hand (jsonschema is not a dependency).
    assert isinstance(value, dict) and set(value) == {"name", "age", "ok"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert isinstance(value["ok"], bool)


def test_without_a_grammar_the_demo_model_writes_no_json(engine):
    text = _generate(engine, None).text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_json_object_output_parses(engine):
    completion = _generate(engine, Grammar("json_object"))
    assert completion.finish_reason == "stop"
    assert isinstance(json.loads(completion.text), dict)


@pytest.mark.parametrize("prompt", [PROMPT, "def fibonacci(n):"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(engine, prompt, temperature):
    grammar = Grammar.json_schema(SCHEMA)
    completion = _generate(engine, grammar, prompt, temperature=temperature, seed=1)
    assert completion.finish_reason == "stop", completion.text
    _check_person(json.loads(completion.text))


def test_tokens_are_the_argmax_of_the_masked_logits(engine):
    grammar = Grammar.json_schema(SCHEMA)
    completion = _generate(engine, grammar)
    ids = completion.prompt_ids + completion.token_ids
    logits = engine.model.logits(ids[:-1])[len(completion.prompt_ids) - 1 :]  # [N, V]
    constraint = engine.grammars.constraint(grammar)
    for step, token in enumerate(completion.token_ids):
        allowed = constraint.allowed()  # [V]
        assert int(mask_logits(logits[step], allowed).argmax()) == token, step
        constraint.advance(token)
    assert constraint.accepting


def test_mask_equals_the_matchers_token_by_token_check(engine):
    """The bitmask fast path against llguidance's one-token validation, over the whole vocab:
    equal where the grammar is free, a subset (the canonical tokens) where it forces text."""
    grammar = Grammar.json_schema(SCHEMA)
    completion = _generate(engine, grammar)
    constraint = engine.grammars.constraint(grammar)
    free_steps = 0
    for token in completion.token_ids[:8]:
        allowed = constraint.allowed()
        reference = torch.tensor([constraint.accepts(t) for t in range(allowed.numel())])
        assert allowed[token] and not (allowed & ~reference).any()
        if not constraint.forcing:
            assert torch.equal(allowed, reference)
            free_steps += 1
        constraint.advance(token)
    assert free_steps >= 3  # the test compares whole masks, not only subsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mask_logits_equals_its_reference(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=generator, dtype=dtype)
    allowed = torch.rand(1000, generator=generator) < 0.3
    masked = mask_logits(logits, allowed)
    assert masked.dtype == dtype and torch.equal(masked, mask_logits_reference(logits, allowed))
    assert torch.isinf(masked[~allowed]).all() and torch.equal(logits[allowed], masked[allowed])


def test_unconstrained_rows_are_unchanged_by_a_constrained_neighbour(engine):
    prompts = [PROMPT, "def fibonacci(n):"]
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = engine.generate(prompts, plain)
    constrained = engine.new_sequence(
        engine.encode(PROMPT), SamplingParams(max_tokens=12, grammar=Grammar("json_object")), True
    )
    seqs = [engine.new_sequence(engine.encode(p), plain, True) for p in prompts]
    engine._run_to_end([constrained, *seqs])
    assert [s.output_ids for s in seqs] == [c.token_ids for c in alone]
    assert all(s.sampler.plain for s in seqs)


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (Grammar.json_schema({"type": "strin"}), "strin"),
        (Grammar("json_schema", "{not json"), "not a JSON schema"),
        (Grammar.json_schema({"type": "string", "format": "no-such-format"}), "format"),
        (Grammar("lark", "start: nowhere"), "nowhere"),
    ],
)
def test_a_bad_grammar_is_refused_naming_the_problem(engine, grammar, message):
    with pytest.raises(GrammarError, match=message):
        engine.new_sequence([1, 2], SamplingParams(grammar=grammar), with_text=True)


def test_ignore_eos_cannot_go_with_a_grammar():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=Grammar("json_object"), ignore_eos=True)
