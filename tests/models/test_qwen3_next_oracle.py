"""Qwen3-Next against `transformers` (the shared hybrid oracle tests: tests/hybrid_oracle.py):
fused qkvz/ba projections grouped by key head, a dense MLP layer, two layer maps."""

from __future__ import annotations

import pytest

from hybrid_oracle import *  # noqa: F403  the tests, run here for this module's cases


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_next_gqa_groups"])
def case(request: pytest.FixtureRequest) -> str:
    return request.param
