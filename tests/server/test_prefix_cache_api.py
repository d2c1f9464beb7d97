"""The prefix cache through the API, with the official `openai` client: a chat's next turn
reports the reused prompt tokens in `usage.prompt_tokens_details.cached_tokens` (whole and
streamed), its reply equals the engine's without a cache, and /v1/stats reports the cache."""

from __future__ import annotations

import pytest

from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.config import PREFIX_BLOCK_TOKENS as BLOCK
from hybridmoe.server.app import stats_body
from hybridmoe.server.generation import ServedModel
from live_server import TEST_MAX_SEQ_LEN

SYSTEM = "You are a patient tutor. Explain with one small example, then stop. " * 4
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a list?"}]
EXACT = {"ignore_eos": True}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def engine(demo_checkpoint) -> Engine:
    """The reference: the same checkpoint in-process, without a prefix cache."""
    config = EngineConfig(dtype="float32", max_seq_len=TEST_MAX_SEQ_LEN, prefix_cache_tokens=0)
    with Engine.from_pretrained(demo_checkpoint, config) as engine:
        yield engine


def prompt_ids(engine: Engine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages)
    return engine.encode(text, add_special_tokens=False)


def shared_whole_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while (n + 1) * BLOCK <= min(len(a), len(b)) and a[: (n + 1) * BLOCK] == b[: (n + 1) * BLOCK]:
        n += 1
    return n


def chat(client, model, messages, **kwargs):
    kwargs = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": EXACT} | kwargs
    return client.chat.completions.create(model=model, messages=messages, **kwargs)


def test_a_chats_second_turn_reuses_the_first_turns_prompt(client, server, engine):
    first = chat(client, server.model_id, FIRST)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second_messages = [
        *FIRST,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And a tuple?"},
    ]
    second = chat(client, server.model_id, second_messages)
    ids, first_ids = prompt_ids(engine, second_messages), prompt_ids(engine, FIRST)
    reused = shared_whole_blocks(ids, first_ids) * BLOCK
    assert reused >= 4 * BLOCK, "the system prompt alone is several blocks"
    assert second.usage.prompt_tokens_details.cached_tokens == reused
    assert second.usage.prompt_tokens == len(ids)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    (reference,) = engine.generate_ids([ids], params)
    assert second.choices[0].message.content == engine.tokenizer.decode(reference)

    stream = chat(
        client,
        server.model_id,
        second_messages,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = list(stream)[-1].usage
    whole_prompt = (len(ids) // BLOCK) * BLOCK  # now cached too, but for its last token
    assert usage.prompt_tokens_details.cached_tokens == min(whole_prompt, len(ids) - 1)

    stats = server.stats()["prefix_cache"]
    cached = reused + usage.prompt_tokens_details.cached_tokens
    assert stats["hit_tokens"] == cached
    assert stats["queried_tokens"] == len(first_ids) + 2 * len(ids)
    assert stats["hit_rate"] == round(cached / stats["queried_tokens"], 4)
    assert stats["blocks_total"] == TEST_MAX_SEQ_LEN // BLOCK  # the default: --max-seq-len
    assert stats["blocks_used"] == len(ids) // BLOCK


def test_stats_say_null_when_the_prefix_cache_is_off(engine):
    assert stats_body(ServedModel("demo", engine, created=0))["prefix_cache"] is None
