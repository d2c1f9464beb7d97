"""The oracle tests of the hybrid linear-attention families, shared by
tests/models/test_qwen3_next_oracle.py and test_qwen3_5_moe_oracle.py: each module defines the
`case` fixture (a tests/hybrid_checkpoints.py case) and imports these.

Against `transformers` in float32: logits of prompts of 1, 7, 64 and 300 tokens (around the
64-token chunks of the prefill form); greedy tokens through every decode target (expert cache
of 3 slots for offload and hybrid); requests of different lengths batched through the
scheduler; a request joining a running batch; a row reused by a later request. A variant case
(another layout of the same family) runs the oracle checks only (logits, greedy on the hybrid
target, batched requests): the engine's mechanics are the same for it, tested on its main case.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hybrid_checkpoints import hf_greedy, hf_model, write_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.models.loading import load_model
from hybridmoe.moe.config import OffloadConfig

N_GREEDY = 8
# fp32 against fp32, summation order only; but the delta-rule state carries rounding along the
# sequence: at 300 tokens transformers' own fp32 logits differ from its fp64 ones by 6.4e-4
# (ours: 5.2e-4 from fp64, 8.9e-4 from its fp32; measured on the qwen3_next case).
LOGITS_ATOL, LOGITS_RTOL = 2e-3, 1e-4
MIN_REFERENCE_GAP = 1e-3  # below it a greedy mismatch could be rounding
GREEDY = SamplingParams(max_tokens=N_GREEDY, temperature=0.0, ignore_eos=True)
_rng = random.Random(17)
PROMPTS = {n: [_rng.randrange(3, 96) for _ in range(n)] for n in (1, 7, 64, 300)}
MAIN_CASES = ("qwen3_next", "qwen3_5_moe")  # the others: the oracle checks only (see above)
TARGETS = {
    "resident": OffloadConfig(decode_target="resident"),
    "cpu": OffloadConfig(decode_target="cpu"),
    "offload": OffloadConfig(decode_target="offload", expert_cache_slots=3),
    "hybrid": OffloadConfig(decode_target="hybrid", expert_cache_slots=3, max_fetch=1),
}


@dataclass(frozen=True)
class Reference:
    directory: Path
    tokens: dict[int, list[int]]  # prompt length -> HF greedy tokens
    logits: dict[int, torch.Tensor]  # prompt length -> [T + N_GREEDY - 1, V] HF logits


@pytest.fixture(scope="module")
def reference(case: str, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    directory = write_checkpoint(case, tmp_path_factory.mktemp(case))
    model = hf_model(directory)
    tokens, logits = {}, {}
    for n, prompt in PROMPTS.items():
        tokens[n], logits[n] = hf_greedy(model, prompt, N_GREEDY)
    return Reference(directory, tokens, logits)


def make_engine(reference: Reference, offload: OffloadConfig, max_batch: int = 4) -> Engine:
    config = EngineConfig(dtype="float32", max_batch=max_batch, max_seq_len=400, offload=offload)
    return Engine.from_pretrained(reference.directory, config)


def main_case_only(case: str) -> None:
    if case not in MAIN_CASES:
        pytest.skip(f"engine mechanics: run on the main cases {MAIN_CASES}")


@pytest.fixture(scope="module")
def engine(reference: Reference):
    with make_engine(reference, TARGETS["hybrid"]) as engine:
        yield engine


def test_reference_greedy_is_far_from_ties(reference: Reference) -> None:
    for n, logits in reference.logits.items():
        top2 = logits[n - 1 :].topk(2, dim=-1).values
        gaps = top2[:, 0] - top2[:, 1]
        assert gaps.min() >= MIN_REFERENCE_GAP, f"prompt {n}: top-2 gaps {gaps.tolist()}"


@pytest.mark.parametrize("n", PROMPTS)
def test_logits_match_transformers(reference: Reference, engine: Engine, n: int) -> None:
    ours = engine.model.logits(PROMPTS[n] + reference.tokens[n][:-1])  # [T, V]
    torch.testing.assert_close(ours, reference.logits[n], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_bfloat16_prefill_logits_match_transformers(case: str, reference: Reference) -> None:
    # bf16 rounds where transformers rounds (norms, conv state, the delta rule in float32):
    # measured bitwise equal on the CPU; the tolerance is one bf16 step at the logits' scale.
    main_case_only(case)
    prompt = PROMPTS[64]
    with torch.no_grad():
        theirs = hf_model(reference.directory, torch.bfloat16)(input_ids=torch.tensor([prompt]))
    ours = load_model(reference.directory, torch.bfloat16).logits(prompt)
    torch.testing.assert_close(ours, theirs.logits[0].float(), atol=0.05, rtol=0)


@pytest.mark.parametrize("target", TARGETS)
def test_greedy_matches_transformers_on_every_target(
    case: str, reference: Reference, target: str
) -> None:
    if target != "hybrid":
        main_case_only(case)
    with make_engine(reference, TARGETS[target]) as engine:
        for n, prompt in PROMPTS.items():
            [ours] = engine.generate_ids([prompt], GREEDY)
            assert ours == reference.tokens[n], f"prompt of {n} tokens on {target}"


def test_batched_requests_of_different_lengths(reference: Reference, engine: Engine) -> None:
    ours = engine.generate_ids(list(PROMPTS.values()), GREEDY)
    assert ours == list(reference.tokens.values())


def test_request_joins_a_running_batch(case: str, reference: Reference, engine: Engine) -> None:
    main_case_only(case)
    outputs: dict[int, list] = {n: [] for n in PROMPTS}
    seqs = {n: engine.new_sequence(p, GREEDY, with_text=False) for n, p in PROMPTS.items()}
    scheduler = engine.scheduler
    for n in (300, 7):
        scheduler.submit(seqs[n], outputs[n].append)
    for _ in range(3):  # the first two decode a few tokens before the others arrive
        scheduler.step()
    for n in (1, 64):
        scheduler.submit(seqs[n], outputs[n].append)
    while not all(out and out[-1].finished for out in outputs.values()):
        scheduler.step()
    assert {n: seq.output_ids for n, seq in seqs.items()} == reference.tokens


def test_a_reused_row_does_not_see_the_previous_request(case: str, reference: Reference):
    main_case_only(case)
    with make_engine(reference, TARGETS["hybrid"], max_batch=1) as engine:
        first, second = engine.generate_ids([PROMPTS[300]], GREEDY), None
        conv, delta = engine.scheduler.cache.recurrent_state(0)
        assert delta.abs().max() > 0.01 and conv.abs().max() > 0.01  # a leak would matter
        for n in (64, 7, 1):
            [second] = engine.generate_ids([PROMPTS[n]], GREEDY)  # row 0 again
            assert second == reference.tokens[n]
    assert first == [reference.tokens[300]]


def test_decode_logits_after_a_previous_occupant_match_a_fresh_cache(case: str, reference):
    main_case_only(case)
    with make_engine(reference, TARGETS["resident"], max_batch=1) as engine:
        model = engine.model
        used, fresh = (KVCache(model.cfg, 1, 400, model.dtype) for _ in range(2))
        _decode(model, PROMPTS[300], used, steps=4)
        after = _decode(model, PROMPTS[7], used, steps=4)
        alone = _decode(model, PROMPTS[7], fresh, steps=4)
    torch.testing.assert_close(after, alone, atol=0, rtol=0)


def _decode(model, prompt: list[int], cache: KVCache, steps: int) -> torch.Tensor:
    """[steps, V] logits of greedy decode steps after `prompt`, in row 0 of `cache`."""
    batch = model.make_batch(torch.arange(len(prompt))[None], [0], cache)
    token, rows = int(model.forward(torch.tensor([prompt]), batch).argmax()), []
    for i in range(steps):
        batch = model.make_batch(torch.tensor([[len(prompt) + i]]), [0], cache, is_decode=True)
        rows.append(model.forward(torch.tensor([[token]]), batch)[0])
        token = int(rows[-1].argmax())
    return torch.stack(rows)


def test_prefix_cache_is_refused(case: str, reference: Reference) -> None:
    main_case_only(case)
    config = EngineConfig(dtype="float32", max_seq_len=400, prefix_cache_tokens=64)
    with pytest.raises(ValueError, match="recurrent state"):
        Engine.from_pretrained(reference.directory, config)


def test_prefix_cache_is_off_by_default(engine: Engine) -> None:
    assert engine.scheduler.prefix_cache is None
