"""Reasoning in chat replies through a real server and the official `openai` client: harmony's
analysis channel and a <think> block come back as `reasoning_content`, whole and streamed.

The demo model speaks neither format, so its replies are scripted: each test names the tokens
the engine must generate, and a constraint that allows only the script's next token (past the
script's end, any token) makes the real engine, scheduler and detokenizer produce them. For
harmony the demo's vocabulary gets gpt-oss's special tokens as new ids (and embedding rows),
its template a harmony rendering that echoes `reasoning_effort`. `hybridmoe chat` is checked
here too, on the same scripted engine."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file

from hybridmoe.cli_chat import chat_loop
from hybridmoe.engine import Engine, EngineConfig, SamplingParams
from hybridmoe.engine.constraints import Grammar
from hybridmoe.engine.sampling import Sampler
from hybridmoe.server.app import create_app
from hybridmoe.server.config import ServerConfig
from live_server import TEST_MAX_SEQ_LEN
from safetensors_layout import write_safetensors
from server import inprocess
from server.test_setup import run_serve

HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
HARMONY_TEMPLATE = """\
{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}
{{- '<|start|>system<|message|>Reasoning: ' + reasoning_effort + '<|end|>' }}
{%- if tools %}{{- '<|start|>developer<|message|>' }}
{%- for tool in tools %}{{- 'functions.' + tool.function.name + '\\n' }}{%- endfor %}
{{- '<|end|>' }}{%- endif %}
{%- for message in messages %}
{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
{#- a call in the history: <|channel|>commentary to=functions.NAME<|message|>ARGS<|call|> #}
"""
THINK_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.reasoning_content %}
{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
{%- endif %}
{{- message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}{%- endif %}
"""
ANALYSIS = "The user says hi. Reply <briefly>, é 😀."
FINAL = "Hello! 2 < 3."
LEAK = " and more"  # scripted after the stop token: it shows up only if generation went on
HARMONY_REPLY = (
    f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>{LEAK}"
)
MESSAGES = [{"role": "user", "content": "hi"}]


class ScriptedTokens:
    """A TokenConstraint allowing only the script's next token; past its end, any token."""

    def __init__(self, script: list[int], vocab_size: int) -> None:
        self._script, self._vocab_size, self._taken = script, vocab_size, 0

    def allowed(self) -> torch.Tensor:
        if self._taken >= len(self._script):
            return torch.ones(self._vocab_size, dtype=torch.bool)
        mask = torch.zeros(self._vocab_size, dtype=torch.bool)
        mask[self._script[self._taken]] = True
        return mask

    def advance(self, token_id: int) -> None:
        self._taken += 1


class Scripts:
    """Installed on an engine: the reply the next request gets (`next_reply`), and the prompts
    the scripted requests had."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.prompts = engine, []
        self._next: list[int] | None = None
        new_sequence = engine.new_sequence

        def scripted(prompt_ids, params, with_text, max_len=None):
            seq = new_sequence(prompt_ids, params, with_text, max_len)
            if self._next is not None:  # the engine's own sequence, its sampler forced
                self.prompts.append(engine.tokenizer.decode(prompt_ids, False))
                seq.params = dataclasses.replace(params, grammar=Grammar("lark", 'start: ""'))
                seq.constraint = ScriptedTokens(self._next, engine.model.cfg.vocab_size)
                seq.sampler = Sampler(seq.params, seq.constraint)
                self._next = None
            return seq

        engine.new_sequence = scripted

    def next_reply(self, text: str) -> None:
        self._next = self.engine.tokenizer.encode(text, add_special_tokens=False)


def _checkpoint(demo: Path, directory: Path, template: str, tokens: tuple[str, ...]) -> Path:
    """The demo with `template` and `tokens` added to its vocabulary as special tokens."""
    rewritten = ("config.json", "tokenizer.json", "model.safetensors") if tokens else ()
    shutil.copytree(demo, directory, ignore=shutil.ignore_patterns(*rewritten))
    (directory / "chat_template.jinja").write_text(template)
    if not tokens:
        return directory
    config = json.loads((demo / "config.json").read_text())
    tokenizer = json.loads((demo / "tokenizer.json").read_text())
    first = config["vocab_size"]
    tokenizer["added_tokens"] += [
        {"id": first + i, "content": token, "single_word": False, "lstrip": False}
        | {"rstrip": False, "normalized": False, "special": True}
        for i, token in enumerate(tokens)
    ]
    config["vocab_size"] = first + len(tokens)
    weights = load_file(str(demo / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]  # [V, H], tied to the LM head
    rows = torch.randn(len(tokens), embed.shape[1], generator=torch.Generator().manual_seed(0))
    weights["model.embed_tokens.weight"] = torch.cat([embed, rows * embed.std()])
    write_safetensors(directory / "model.safetensors", dict(sorted(weights.items())))
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


@pytest.fixture(scope="module")
def harmony_checkpoint(demo_checkpoint: Path, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("harmony") / "demo-harmony"
    return _checkpoint(demo_checkpoint, directory, HARMONY_TEMPLATE, HARMONY_TOKENS)


@pytest.fixture(scope="module")
def think_checkpoint(demo_checkpoint: Path, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("think") / "demo-think"
    return _checkpoint(demo_checkpoint, directory, THINK_TEMPLATE, ())


Served = tuple[openai.OpenAI, Scripts]


@contextmanager
def scripted_server(checkpoint: Path, **config_fields) -> Iterator[Served]:
    """(openai client, Scripts) of an in-process server over an engine of `checkpoint`, its
    ServerConfig made of `config_fields`."""
    config = EngineConfig(max_seq_len=TEST_MAX_SEQ_LEN, max_batch=2)
    with Engine.from_pretrained(checkpoint, config) as engine:
        scripts = Scripts(engine)
        app = create_app(engine, "m", config=ServerConfig(**config_fields))
        with inprocess.serving(app) as url:
            yield inprocess.client(url), scripts


@pytest.fixture(scope="module")
def harmony(harmony_checkpoint: Path) -> Iterator[Served]:
    with scripted_server(harmony_checkpoint) as served:
        yield served


@pytest.fixture(scope="module")
def think(think_checkpoint: Path) -> Iterator[Served]:
    with scripted_server(think_checkpoint) as served:
        yield served


def chat(client, stream=False, **kwargs):
    kwargs = {"max_tokens": 80, "temperature": 0, "messages": MESSAGES} | kwargs
    return client.chat.completions.create(model="m", stream=stream, **kwargs)


def assemble(chunks) -> tuple[str, str, dict[int, dict], str | None]:
    """(reasoning, content, tool calls by index, finish_reason) a client assembles."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reasoning += getattr(choice.delta, "reasoning_content", None) or ""
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or []:
            call = calls.setdefault(part.index, {"name": "", "arguments": ""})
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_harmony_analysis_is_reasoning_and_final_the_content(harmony):
    client, scripts = harmony
    scripts.next_reply(HARMONY_REPLY)
    choice = chat(client).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == (ANALYSIS, FINAL)
    assert choice.finish_reason == "stop"  # at <|return|>, which the checkpoint's EOS is not
    scripts.next_reply(HARMONY_REPLY)
    assert assemble(chat(client, stream=True)) == (ANALYSIS, FINAL, {}, "stop")


def test_harmony_commentary_call_is_a_tool_call(harmony):
    client, scripts = harmony
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    reply = (
        f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>commentary"
        ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>' + LEAK
    )
    scripts.next_reply(reply)
    choice = chat(client, tools=tools).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == ANALYSIS
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "functions.get_weather" in scripts.prompts[-1]  # the template offered the tool
    scripts.next_reply(reply)
    reasoning, content, calls, finish = assemble(chat(client, stream=True, tools=tools))
    assert (reasoning, content, finish) == (ANALYSIS, "", "tool_calls")
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}


def test_harmony_calls_cannot_be_required(harmony):
    client, _ = harmony
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, tools=tools, tool_choice="required")
    assert caught.value.param == "tool_choice" and "harmony" in caught.value.message


@pytest.mark.parametrize("effort", ["low", "high", None])
def test_reasoning_effort_reaches_the_template(harmony, effort):
    client, scripts = harmony
    scripts.next_reply(HARMONY_REPLY)
    chat(client, **({} if effort is None else {"reasoning_effort": effort}))
    expected = f"<|start|>system<|message|>Reasoning: {effort or 'medium'}<|end|>"
    assert scripts.prompts[-1].startswith(expected), scripts.prompts[-1]


@pytest.mark.parametrize("effort", ["extreme", "", 3])
def test_a_bad_reasoning_effort_is_a_400_naming_it(harmony, effort):
    client, _ = harmony
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, reasoning_effort=effort)
    assert caught.value.param == "reasoning_effort", caught.value.message


def test_think_block_is_reasoning(think):
    client, scripts = think
    reply = f"<think>\n{ANALYSIS}\n</think>\n\n{FINAL}<|im_end|>{LEAK}"
    scripts.next_reply(reply)
    choice = chat(client).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == (ANALYSIS, FINAL)
    scripts.next_reply(reply)
    assert assemble(chat(client, stream=True)) == (ANALYSIS, FINAL, {}, "stop")


def test_chat_template_kwargs_reach_the_template(think):
    client, scripts = think
    scripts.next_reply(f"{FINAL}<|im_end|>")
    message = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert scripts.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (message.choices[0].message.reasoning_content, message.choices[0].message.content) == (
        None,
        FINAL,
    )
    for bad in ({"messages": []}, {"eos_token": "x"}, ["enable_thinking"]):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, extra_body={"chat_template_kwargs": bad})
        assert caught.value.param == "chat_template_kwargs", caught.value.message


def test_history_reasoning_reaches_the_template(think):
    client, scripts = think
    answered = {"role": "assistant", "content": FINAL, "reasoning_content": ANALYSIS}
    scripts.next_reply(f"{FINAL}<|im_end|>")
    chat(client, messages=[*MESSAGES, answered, {"role": "user", "content": "again"}])
    assert f"<think>\n{ANALYSIS}\n</think>\n\n{FINAL}<|im_end|>" in scripts.prompts[-1]


def test_reasoning_format_none_leaves_the_text_as_content(think_checkpoint):
    reply = f"<think>{ANALYSIS}</think>{FINAL}"
    with scripted_server(think_checkpoint, reasoning_format="none") as (client, scripts):
        scripts.next_reply(reply + "<|im_end|>")
        message = chat(client).choices[0].message
    assert (message.reasoning_content, message.content) == (None, reply)


def test_without_a_reasoning_format_content_is_verbatim(demo_checkpoint):
    reply = f"  <think>{ANALYSIS}</think>{FINAL}"
    with scripted_server(demo_checkpoint) as (client, scripts):  # auto: the demo's template
        scripts.next_reply(reply + "<|im_end|>")  # speaks neither format
        message = chat(client).choices[0].message
    assert (message.reasoning_content, message.content) == (None, reply)


def test_serve_refuses_harmony_for_a_vocabulary_without_its_tokens(demo_checkpoint):
    result = run_serve("--model", str(demo_checkpoint), "--reasoning-format", "harmony")
    assert result.returncode == 2, result.stderr
    assert "<|return|>" in result.stderr and "--reasoning-format" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_chat_command_prints_the_final_channel(harmony_checkpoint, monkeypatch, capsys):
    turns = iter(["hi"])

    def typed(prompt: str) -> str:
        try:
            return next(turns)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", typed)
    config = EngineConfig(max_seq_len=TEST_MAX_SEQ_LEN, max_batch=1)
    with Engine.from_pretrained(harmony_checkpoint, config) as engine:
        scripts = Scripts(engine)
        scripts.next_reply(HARMONY_REPLY)
        chat_loop(engine, None, SamplingParams(max_tokens=80))
    printed = capsys.readouterr()
    assert printed.out == FINAL + "\n"  # the answer alone, up to <|return|>
    assert ANALYSIS in printed.err and "<|" not in printed.err
