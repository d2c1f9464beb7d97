"""Sampling: parameter validation, top-k/top-p masks against Hugging Face, seeded samplers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from hybridmoe.engine.sampling import (
    Sampler,
    SamplingParams,
    apply_top_k,
    apply_top_p,
    sample_batch,
)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale  # [B, V]


def draw(sampler: Sampler, logits: torch.Tensor, n: int) -> list[int]:
    return [sampler.sample(logits) for _ in range(n)]


# --- SamplingParams -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
        ("max_tokens", 2.5, "max_tokens must be an integer"),
        ("temperature", -0.1, "temperature must be >= 0"),
        ("temperature", math.nan, "temperature must be >= 0"),
        ("temperature", math.inf, "temperature must be >= 0"),
        ("top_k", -1, "top_k must be >= 0, got -1"),
        ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
        ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
        ("top_p", math.nan, "top_p must be in (0, 1]"),
        ("seed", -1, "seed must be in [0, 2**64), got -1"),
        ("seed", "7", "seed must be an integer or None"),
        ("stop", [""], "stop strings must be non-empty"),
        ("stop", [3], "stop strings must be non-empty strings, got 3"),
        ("stop", 3, "stop must be a string or a list of strings"),
        ("ignore_eos", "yes", "ignore_eos must be True or False"),
    ],
)
def test_invalid_params_name_the_field(field, value, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    assert message in str(excinfo.value)


def test_stop_is_normalised_to_a_tuple():
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop="</s>").stop == ("</s>",)
    assert SamplingParams().stop == ()


def test_params_are_frozen_and_greedy_means_temperature_zero():
    params = SamplingParams()
    assert params.greedy
    assert not SamplingParams(temperature=0.7).greedy
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_a_tiny_temperature_is_greedy(temperature):
    # float32 cannot divide by these (1e-300 is 0 in float32): the draw would be nan
    params = SamplingParams(temperature=temperature, seed=3)
    assert params.greedy
    logits = torch.tensor([0.5, 2.0, 1.0, 2.0 - 1e-3])
    assert Sampler(params).sample(logits) == 1
    assert sample_batch(torch.stack([logits, logits.flip(0)]), [Sampler(params)] * 2) == [1, 2]


# --- masks ----------------------------------------------------------------------------------


def test_top_k_keeps_exactly_k_distinct_values():
    logits = random_logits(4, 50, seed=0)
    masked = apply_top_k(logits, 5)
    assert (masked.isfinite().sum(dim=-1) == 5).all()
    top5 = torch.topk(logits, 5, dim=-1).indices
    assert torch.equal(masked.gather(-1, top5), logits.gather(-1, top5))


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    masked = apply_top_k(logits, 2)
    assert masked.isfinite().tolist() == [[True, False, True, True, False]]


@pytest.mark.parametrize("k", [0, 7, 100])
def test_top_k_off_or_larger_than_vocab_is_a_no_op(k):
    logits = random_logits(2, 7, seed=1)
    assert torch.equal(apply_top_k(logits, k), logits)


def test_masks_do_not_modify_their_input():
    logits = random_logits(2, 30, seed=2)
    before = logits.clone()
    apply_top_k(logits, 3)
    apply_top_p(logits, 0.5)
    assert torch.equal(logits, before)


def test_top_p_hand_computed_example():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()

    def keep(p: float) -> list[bool]:
        return apply_top_p(logits, p).isfinite().tolist()[0]

    assert keep(0.4) == [True, False, False, False]
    assert keep(0.7) == [True, True, False, False]  # 0.5 + 0.3 = 0.8 >= 0.7
    assert keep(0.9) == [True, True, True, False]  # 0.95 >= 0.9
    assert keep(0.99) == [True, True, True, True]
    assert keep(1.0) == [True, True, True, True]


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 10.0]])
    assert apply_top_p(logits, 1e-9).isfinite().tolist() == [[False] * 4 + [True]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [1, 3, 40, 255])
def test_top_k_matches_transformers(seed, k):
    logits = random_logits(8, 256, seed=seed)
    expected = TopKLogitsWarper(top_k=k)(None, logits)
    assert torch.equal(apply_top_k(logits, k), expected)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_matches_transformers(seed, p):
    logits = random_logits(8, 256, seed=seed)
    expected = TopPLogitsWarper(top_p=p)(None, logits)
    assert torch.equal(apply_top_p(logits, p), expected)


# --- Sampler --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = random_logits(6, 100, seed=3).to(dtype)
    sampler = Sampler(SamplingParams())
    assert [sampler.sample(row) for row in logits] == logits.argmax(dim=-1).tolist()


def test_same_seed_same_tokens_and_different_seeds_differ():
    flat = torch.zeros(1000)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = draw(Sampler(params), flat, 20)
    assert draw(Sampler(params), flat, 20) == first
    assert draw(Sampler(SamplingParams(temperature=1.0, seed=4321)), flat, 20) != first


def test_unseeded_samplers_get_different_random_seeds():
    flat = torch.zeros(1000)
    params = SamplingParams(temperature=1.0)
    assert draw(Sampler(params), flat, 20) != draw(Sampler(params), flat, 20)


def test_seeded_request_is_unaffected_by_its_neighbours():
    logits = random_logits(3, 64, seed=4, scale=1.0)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=7)
    solo = Sampler(seeded)
    alone = [solo.sample(logits[0]) for _ in range(10)]
    batch_samplers = [Sampler(seeded), Sampler(SamplingParams(temperature=1.0)), Sampler(seeded)]
    together = [sample_batch(logits, batch_samplers) for _ in range(10)]
    assert [row[0] for row in together] == alone


def test_tiny_temperature_is_greedy():
    logits = random_logits(20, 500, seed=5)
    for temperature in (1e-5, 1e-30):
        sampler = Sampler(SamplingParams(temperature=temperature, seed=0))
        assert [sampler.sample(row) for row in logits] == logits.argmax(dim=-1).tolist()


def test_draws_follow_the_softmax_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=11))
    counts = torch.bincount(torch.tensor(draw(sampler, logits, 4000)), minlength=4)
    observed = counts.float() / counts.sum()
    expected = logits.softmax(dim=-1)
    max_diff = (observed - expected).abs().max().item()
    assert max_diff < 0.03, f"max |observed - expected| = {max_diff:.4f}"


def test_sample_rejects_batched_logits():
    with pytest.raises(ValueError, match=r"shape \[V\]"):
        Sampler(SamplingParams()).sample(torch.zeros(2, 5))


def test_sample_batch_greedy_fast_path_and_mixed_rows():
    logits = random_logits(4, 100, seed=6)
    argmax = logits.argmax(dim=-1).tolist()
    assert sample_batch(logits, [Sampler(SamplingParams())] * 4) == argmax
    mixed = [Sampler(SamplingParams(temperature=1e-6 if b % 2 else 0.0, seed=b)) for b in range(4)]
    assert sample_batch(logits, mixed) == argmax
    with pytest.raises(ValueError, match="len\\(samplers\\)"):
        sample_batch(logits, [Sampler(SamplingParams())])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_batch_greedy_picks_torch_argmax_on_ties_nan_and_inf(dtype):
    """The greedy fast path (numpy's argmax over float32 host logits) picks what torch.argmax
    picks: the first of tied maxima, the first NaN, an all -inf row's first id."""
    nan, inf = float("nan"), float("inf")
    rows = [[1, 3, 3, 2], [nan, 1, nan, 5], [1, nan, 9, 9], [-inf] * 4, [inf, 1, inf, 0]]
    g = torch.Generator().manual_seed(3)
    small = torch.randint(0, 4, (40, 50), generator=g).float()  # many ties
    small[small == 3] = nan
    for logits in (torch.tensor(rows), small, small.clamp(max=2)):
        logits = logits.to(dtype)
        samplers = [Sampler(SamplingParams())] * logits.shape[0]
        assert sample_batch(logits, samplers) == logits.argmax(dim=-1).tolist()


@settings(max_examples=100, deadline=None)
@given(
    raw=st.lists(st.integers(-12, 12), min_size=1, max_size=40),
    k=st.integers(0, 45),
    p=st.floats(0.01, 1.0),
    temperature=st.sampled_from([0.25, 0.5, 1.0, 2.0]),
    seed=st.integers(0, 2**32),
)
def test_sampler_never_picks_a_masked_token(raw, k, p, temperature, seed):
    # Integer logits and power-of-two temperatures scale exactly, so ties stay ties.
    logits = torch.tensor(raw, dtype=torch.float32)  # [V]
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=k, top_p=p, seed=seed))
    kth_largest = torch.sort(logits, descending=True).values[min(k, len(raw)) - 1] if k else -1e9
    in_top_k = logits >= kth_largest
    probs = torch.where(in_top_k, logits.double() / temperature, -math.inf).softmax(dim=-1)
    for token in draw(sampler, logits, 10):
        assert in_top_k[token], f"token {token} is outside the top-{k}"
        mass_strictly_above = probs[logits > logits[token]].sum().item()
        assert mass_strictly_above < p + 1e-6, f"token {token} is outside the top-p={p} nucleus"
