"""Qwen3.5-MoE against `transformers` (the shared hybrid oracle tests: tests/hybrid_oracle.py):
Qwen3_5MoeForCausalLM, and the text model of Qwen3_5MoeForConditionalGeneration (weights under
model.language_model, the vision tower left unread)."""

from __future__ import annotations

import pytest

from hybrid_oracle import *  # noqa: F403  the tests, run here for this module's cases


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_5_moe_multimodal"])
def case(request: pytest.FixtureRequest) -> str:
    return request.param
