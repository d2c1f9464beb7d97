"""Oracle: our logits and greedy tokens against Hugging Face `transformers`, in float32, on tiny
random checkpoints that `transformers` wrote itself (see tests/hf_checkpoints.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hf_checkpoints import (
    ORACLE_CASES,
    PROMPT_IDS,
    SHORT_PROMPT_IDS,
    hf_greedy,
    hf_logits,
    top2_gap,
    write_hf_checkpoint,
)
from hybridmoe.engine import Engine, EngineConfig, SamplingParams

N_GREEDY = 20
# fp32 against fp32: only summation order differs (HF sorts tokens by expert and uses sdpa).
LOGITS_ATOL = LOGITS_RTOL = 1e-4
# Below this top-2 gap a greedy mismatch could be rounding, not a bug.
MIN_REFERENCE_GAP = 1e-3
GREEDY = SamplingParams(max_tokens=N_GREEDY, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Reference:
    directory: Path
    tokens: list[int]  # HF greedy continuation of PROMPT_IDS
    short_tokens: list[int]  # HF greedy continuation of SHORT_PROMPT_IDS
    logits: torch.Tensor  # [T, V] HF logits of PROMPT_IDS + tokens[:-1]
    short_logits: torch.Tensor  # [T', V] the same for SHORT_PROMPT_IDS

    @property
    def sequence(self) -> list[int]:
        """The prompt and every generated token but the last: covers each decode position."""
        return PROMPT_IDS + self.tokens[:-1]


@pytest.fixture(scope="module", params=ORACLE_CASES, ids=["-".join(case) for case in ORACLE_CASES])
def reference(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    family, variant = request.param
    directory = write_hf_checkpoint(family, variant, tmp_path_factory.mktemp(f"{family}-{variant}"))
    tokens = hf_greedy(directory, PROMPT_IDS, N_GREEDY)
    short_tokens = hf_greedy(directory, SHORT_PROMPT_IDS, N_GREEDY)
    return Reference(
        directory=directory,
        tokens=tokens,
        short_tokens=short_tokens,
        logits=hf_logits(directory, PROMPT_IDS + tokens[:-1]),
        short_logits=hf_logits(directory, SHORT_PROMPT_IDS + short_tokens[:-1]),
    )


@pytest.fixture(scope="module")
def engine(reference: Reference):
    engine = Engine.from_pretrained(reference.directory, EngineConfig(dtype="float32"))
    yield engine
    engine.close()


def test_reference_greedy_is_far_from_ties(reference: Reference) -> None:
    # Guards the fixture, not the engine: a near-tie would make the greedy tests meaningless.
    for prompt, logits in (
        (PROMPT_IDS, reference.logits),
        (SHORT_PROMPT_IDS, reference.short_logits),
    ):
        gaps = top2_gap(logits[len(prompt) - 1 :])
        assert gaps.min() >= MIN_REFERENCE_GAP, f"reweight this case: top-2 gaps {gaps.tolist()}"


def test_logits_match_transformers(reference: Reference, engine: Engine) -> None:
    ours = engine.model.logits(reference.sequence)  # [T, V]
    # On failure assert_close reports the greatest absolute difference and where it is.
    torch.testing.assert_close(ours, reference.logits, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_greedy_matches_transformers(reference: Reference, engine: Engine) -> None:
    [ours] = engine.generate_ids([PROMPT_IDS], GREEDY)
    assert ours == reference.tokens


def test_batched_greedy_matches_transformers(reference: Reference, engine: Engine) -> None:
    ours = engine.generate_ids([PROMPT_IDS, SHORT_PROMPT_IDS], GREEDY)
    assert ours == [reference.tokens, reference.short_tokens]
