"""The OpenAI-compatible API of a live server, driven by the official `openai` client: chat and
completions, whole and streamed, stop sequences, usage, and concurrent clients."""

from __future__ import annotations

import threading

import pytest

from hybridmoe.engine import Engine, EngineConfig, SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\nx = np.zeros((3, 4))\nfor row in x:\n    print(",
    "Once upon a time",
]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
EXACT = {"ignore_eos": True}  # a vLLM-style extension: exactly max_tokens tokens


@pytest.fixture(scope="module")
def engine(demo_checkpoint) -> Engine:
    """The same checkpoint in-process: the reference the server's output is checked against."""
    return Engine.from_pretrained(demo_checkpoint, EngineConfig(dtype="float32"))


def complete(client, model, prompt, **kwargs):
    kwargs = {"max_tokens": 12, "temperature": 0, "extra_body": EXACT} | kwargs
    return client.completions.create(model=model, prompt=prompt, **kwargs)


def chat(client, model, **kwargs):
    kwargs = {"max_tokens": 12, "temperature": 0, "extra_body": EXACT} | kwargs
    return client.chat.completions.create(model=model, messages=MESSAGES, **kwargs)


def chat_prompt_ids(engine: Engine) -> list[int]:
    text = engine.tokenizer.apply_chat_template(MESSAGES)
    return engine.encode(text, add_special_tokens=False)


def test_models_names_the_checkpoint_directory(client, server):
    assert [m.id for m in client.models.list().data] == [server.model_id]


def test_completion_equals_the_engine(client, server, engine):
    result = complete(client, server.model_id, PROMPTS[0])
    (reference,) = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, ignore_eos=True))
    choice = result.choices[0]
    assert (choice.text, choice.finish_reason) == (reference.text, "length")
    assert result.model == server.model_id and result.object == "text_completion"
    usage = result.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(reference.prompt_ids), 12)
    assert usage.total_tokens == usage.prompt_tokens + 12


def test_completion_from_token_ids(client, server, engine):
    ids = engine.encode(PROMPTS[1])
    by_ids = complete(client, server.model_id, ids).choices[0].text
    assert by_ids == complete(client, server.model_id, PROMPTS[1]).choices[0].text


def test_streamed_completion_joins_to_the_whole(client, server):
    whole = complete(client, server.model_id, PROMPTS[2])
    stream = complete(
        client, server.model_id, PROMPTS[2], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == []
    # cached_tokens differ: the stream reuses the first request's prompt blocks
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(usage_chunk.usage, n) for n in counts] == [
        getattr(whole.usage, n) for n in counts
    ]


def test_chat_completion_uses_the_chat_template(client, server, engine):
    result = chat(client, server.model_id)
    prompt_ids = chat_prompt_ids(engine)
    (reference,) = engine.generate_ids([prompt_ids], SamplingParams(max_tokens=12, ignore_eos=True))
    message = result.choices[0].message
    assert message.role == "assistant"
    assert message.content == engine.tokenizer.decode(reference)
    assert result.choices[0].finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), 12)


def test_streamed_chat_joins_to_the_whole(client, server):
    whole = chat(client, server.model_id)
    chunks = list(chat(client, server.model_id, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # usage only when stream_options asks for it


def test_stop_sequence_cuts_the_text(client, server):
    full = complete(client, server.model_id, PROMPTS[0], max_tokens=24).choices[0].text
    stop = full[len(full) // 2 :][:3]  # occurs in the unstopped text by construction
    cut = complete(client, server.model_id, PROMPTS[0], max_tokens=24, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 24
    streamed = complete(client, server.model_id, PROMPTS[0], max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_seeded_sampling_is_reproducible(client, server):
    def sample():
        return chat(client, server.model_id, temperature=0.9, top_p=0.95, seed=11)

    assert sample().choices[0].message.content == sample().choices[0].message.content


def test_max_tokens_defaults_to_the_rest_of_the_context_in_chat(client, server, engine):
    result = chat(client, server.model_id, max_tokens=None, extra_body={})
    assert result.choices[0].finish_reason in ("stop", "length")
    room = server.stats()["max_seq_len"] - len(chat_prompt_ids(engine))
    assert 1 <= result.usage.completion_tokens <= room


def test_eight_concurrent_clients_each_get_their_output_alone(server):
    jobs = [(PROMPTS[i % len(PROMPTS)], i % 2 == 0) for i in range(8)]  # (prompt, stream)
    client = server.client()
    alone = {
        p: complete(client, server.model_id, p, max_tokens=24).choices[0].text for p in PROMPTS
    }
    results: list[str | None] = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def run(i: int, prompt: str, stream: bool) -> None:
        own_client = server.client()
        start.wait()
        response = complete(own_client, server.model_id, prompt, max_tokens=24, stream=stream)
        chunks = response if stream else [response]
        results[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [alone[prompt] for prompt, _ in jobs]


def test_stats_count_requests_and_tokens(client, server):
    before = server.stats()
    complete(client, server.model_id, PROMPTS[3], max_tokens=5)
    after = server.stats()
    assert after["requests_served"] == before["requests_served"] + 1
    assert after["completion_tokens"] == before["completion_tokens"] + 5
    assert after["decode_tokens_per_s"] > 0
    assert after["requests_running"] == 0 and after["requests_waiting"] == 0
    assert after["decode_target"] == "cpu"  # `auto` on the cpu device
    assert after["experts"]["cpu_route_share"] == 1.0 and after["experts"]["hit_rate"] == 0.0


def test_health(server):
    assert server.get("/health") == (200, {"status": "ok"})
