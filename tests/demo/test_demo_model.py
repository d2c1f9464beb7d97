"""The embedded demo checkpoint: complete and small, writes readable text deterministically,
predicts held-out standard library source far better than token frequencies do, and
`transformers` reads it as we do."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from hybridmoe.demo import CHECKPOINT_FILES, DEMO_MODEL_NAME, require_demo_checkpoint
from hybridmoe.demo.corpus import encode_files, read_texts, split_corpus
from hybridmoe.demo.perplexity import model_perplexity, targets, unigram_perplexity
from hybridmoe.engine import Engine, EngineConfig, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every path below is local

MAX_CHECKPOINT_BYTES = 20_000_000
PROMPTS = ["def fibonacci(n):", "The os module"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
SLICE_TOKENS = 1024  # two windows: a fast test; scripts/eval_demo_model.py scores them all
WINDOW = 512
MAX_PERPLEXITY_RATIO = 1 / 3
# Of the identifiers in each greedy sample, at least this share must be words of the standard
# library, and the samples must hold this many different ones. Random weights string subword
# tokens into non-words or repeat one token (measured: 0.0 known for one prompt, one word).
MIN_KNOWN_WORD_SHARE = 0.8
MIN_DISTINCT_WORDS = 8
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@pytest.fixture(scope="module")
def engine(demo_checkpoint) -> Engine:
    with Engine.from_pretrained(demo_checkpoint, EngineConfig(dtype="float32")) as engine:
        yield engine


@pytest.fixture(scope="module")
def held_out_slice(engine) -> list[int]:
    """The first SLICE_TOKENS tokens of the held-out files (the training script never saw them)."""
    first_files = split_corpus().held_out[:2]
    return encode_files(engine.require_tokenizer().backend, first_files)[:SLICE_TOKENS]


def test_shipped_checkpoint_is_complete_and_small():
    directory = require_demo_checkpoint()
    assert directory.name == DEMO_MODEL_NAME  # the server's model id
    assert sorted(p.name for p in directory.iterdir()) == sorted(CHECKPOINT_FILES)
    assert sum(p.stat().st_size for p in directory.iterdir()) <= MAX_CHECKPOINT_BYTES
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]


def test_greedy_generation_is_deterministic_and_readable(engine):
    first = [c.text for c in engine.generate(PROMPTS, GREEDY)]
    second = [c.text for c in engine.generate(PROMPTS, GREEDY)]
    assert second == first
    corpus_words = {w for text in read_texts(split_corpus().train) for w in WORD.findall(text)}
    for prompt, text in zip(PROMPTS, first, strict=True):
        assert text.strip() and text.isascii(), (prompt, text)
        words = WORD.findall(text)
        known = sum(w in corpus_words for w in words) / max(1, len(words))
        assert known >= MIN_KNOWN_WORD_SHARE, (prompt, text, known)
    assert len({w for text in first for w in WORD.findall(text)}) >= MIN_DISTINCT_WORDS, first


def test_held_out_perplexity_beats_unigram(engine, held_out_slice):
    scored = targets(held_out_slice, WINDOW)
    ppl = model_perplexity(engine.model.logits, held_out_slice, WINDOW)
    # Token frequencies of the scored tokens themselves: no unigram model does better on them.
    unigram_ppl = unigram_perplexity(scored, scored, engine.model.cfg.vocab_size, smoothing=0.0)
    assert ppl <= MAX_PERPLEXITY_RATIO * unigram_ppl, f"ppl {ppl:.2f}, unigram {unigram_ppl:.2f}"


def test_transformers_reads_it_as_we_do(demo_checkpoint, engine, held_out_slice):
    transformers = pytest.importorskip("transformers")
    ids = held_out_slice[:128]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(demo_checkpoint))
    text = engine.require_tokenizer().decode(ids)
    assert tokenizer.encode(text) == engine.encode(text)
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]  # [T, V]
    ours = engine.model.logits(ids)
    diff = (ours - expected).abs().max().item()
    assert torch.allclose(ours, expected, atol=1e-4, rtol=1e-4), f"max |diff| {diff:.2e}"
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
