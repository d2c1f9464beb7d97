"""The reasoning parsers over given text: whole, and streamed in deltas cut at every character
boundary, which must assemble to the whole parse with no part of a marker in the content."""

from __future__ import annotations

import pytest

from hybridmoe.server.reasoning import (
    REASONING_FORMATS,
    HarmonyReasoning,
    Reasoning,
    ThinkReasoning,
    select_reasoning_format,
)
from hybridmoe.server.reply import ReplyParsing, parse_reply
from hybridmoe.server.tools import QwenToolCalls, ToolCall, ToolCallParsing

ANALYSIS = "User greets. Answer <briefly> | kindly; é 😀."
FINAL = "Hello! 2 < 3 and a|b."
HARMONY = (
    f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{FINAL}"
)
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
WEATHER = ToolCall("get_weather", '{"city": "Paris"}')
HARMONY_TEXTS = {
    HARMONY: (ANALYSIS, FINAL, []),
    HARMONY + "<|return|>": (ANALYSIS, FINAL, []),
    f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant{CALL}": (
        ANALYSIS,
        None,
        [WEATHER],
    ),
    "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}": (
        None,
        None,
        [ToolCall("f", "{}")],
    ),
    "<|channel|>commentary to=functions.f<|message|>not json": (None, "not json", []),
    "<|channel|>commentary<|message|>Let me check.<|end|>": (None, "Let me check.", []),
    "<|channel|>commentary to=browser.search<|message|>{}<|end|>": ("{}", None, []),
    f"<|channel|>analysis<|message|>{ANALYSIS}": (ANALYSIS, None, []),  # cut off by max_tokens
    "plain text, no harmony <|": (None, "plain text, no harmony <|", []),
    "": (None, None, []),
}
THINK = f"<think>\n{ANALYSIS}\n</think>\n\n{FINAL}"
THINK_TEXTS = {  # (prompt, text): expected
    ("<|im_start|>assistant\n", THINK): (ANALYSIS, FINAL, []),
    ("<|im_start|>assistant\n", "  <think>a</think>b"): ("a", "b", []),
    ("<|im_start|>assistant\n", f"{FINAL} <think>x</think>"): (
        None,
        f"{FINAL} <think>x</think>",
        [],
    ),
    ("<|im_start|>assistant\n", "<think>\n\n</think>\n\nHi"): (None, "Hi", []),
    ("<|im_start|>assistant\n", "<thin"): (None, "<thin", []),
    ("<|im_start|>assistant\n", f"<think>{ANALYSIS}  "): (ANALYSIS, None, []),
    ("<|im_start|>assistant\n<think>\n", f"{ANALYSIS}</think>{FINAL}"): (ANALYSIS, FINAL, []),
    ("<|im_start|>assistant\n<think>\n", f"{ANALYSIS} </thi"): (f"{ANALYSIS} </thi", None, []),
    ("<|im_start|>assistant\n", "<"): (None, "<", []),
}
CASES = [(HarmonyReasoning, "", t, e) for t, e in HARMONY_TEXTS.items()] + [
    (ThinkReasoning, p, t, e) for (p, t), e in THINK_TEXTS.items()
]
IDS = [f"{f.name}-{i}" for i, (f, *_) in enumerate(CASES)]


def _split(pieces) -> tuple[str | None, str | None, list[ToolCall]]:
    assert all(not isinstance(p, str) or p for p in pieces), "no empty content pieces"
    assert all(not isinstance(p, Reasoning) or p.text for p in pieces), "no empty reasoning"
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    content = "".join(p for p in pieces if isinstance(p, str))
    return reasoning or None, content or None, [p for p in pieces if isinstance(p, ToolCall)]


def _streamed(fmt, prompt: str, deltas: list[str]):
    stream = fmt.stream(prompt)
    pieces = [p for delta in deltas for p in stream.feed(delta)]
    return _split(pieces + stream.finish())


@pytest.mark.parametrize(("fmt", "prompt", "text", "expected"), CASES, ids=IDS)
def test_whole_text(fmt, prompt, text, expected):
    assert parse_reply(ReplyParsing(fmt, prompt), text) == expected


@pytest.mark.parametrize(("fmt", "prompt", "text", "expected"), CASES, ids=IDS)
def test_two_deltas_cut_at_every_boundary(fmt, prompt, text, expected):
    for cut in range(len(text) + 1):
        assert _streamed(fmt, prompt, [text[:cut], text[cut:]]) == expected, cut


@pytest.mark.parametrize(("fmt", "prompt", "text", "expected"), CASES, ids=IDS)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_small_deltas(fmt, prompt, text, expected, size):
    deltas = [text[i : i + size] for i in range(0, len(text), size)]
    assert _streamed(fmt, prompt, deltas) == expected


@pytest.mark.parametrize("size", [1, 2, 3])
def test_no_part_of_a_marker_is_emitted_before_it_is_decided(size):
    stream = HarmonyReasoning.stream("")
    emitted = ""
    for i in range(0, len(HARMONY), size):
        emitted += "".join(p for p in stream.feed(HARMONY[i : i + size]) if isinstance(p, str))
        assert "<|" not in emitted and FINAL.startswith(emitted), emitted
    think = ThinkReasoning.stream("")
    for i in range(len(THINK)):
        pieces = think.feed(THINK[i])
        assert not any("<" in p and "think" in p for p in pieces if isinstance(p, str)), i


def test_analysis_streams_before_the_reply_ends():
    stream = HarmonyReasoning.stream("")
    assert stream.feed("<|channel|>analysis<|message|>Think") == [Reasoning("Think")]
    assert stream.feed("ing.<|e") == [Reasoning("ing.")]
    assert stream.feed("nd|>") == []


def test_a_call_is_emitted_whole():
    stream = HarmonyReasoning.stream("")
    assert stream.feed(CALL) == []
    assert stream.finish() == [WEATHER]


def test_the_format_is_chosen_by_the_template_or_named():
    harmony_template = "{{ '<|start|>assistant<|channel|>final<|message|>' }}"
    think_template = "{{ '<think>\\n' }}"
    assert select_reasoning_format("auto", harmony_template) is HarmonyReasoning
    assert select_reasoning_format("auto", think_template) is ThinkReasoning
    assert select_reasoning_format("auto", "{{ messages }}") is None
    assert select_reasoning_format("none", harmony_template) is None
    assert select_reasoning_format("think", harmony_template) is ThinkReasoning
    assert set(REASONING_FORMATS) == {"harmony", "think"}
    with pytest.raises(ValueError, match="auto, none, harmony, think"):
        select_reasoning_format("o1", "")


QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLIES = {  # (reasoning format, tool parsing): (text, expected)
    (ThinkReasoning, True): (
        f"<think>{ANALYSIS}</think>\n\nLet me look.\n{QWEN_CALL}",
        (ANALYSIS, "Let me look.", [WEATHER]),
    ),
    (ThinkReasoning, False): (f"<think>{ANALYSIS}</think>{QWEN_CALL}", (ANALYSIS, QWEN_CALL, [])),
    (None, True): (f"a {QWEN_CALL}", (None, "a", [WEATHER])),
    (HarmonyReasoning, False): (HARMONY, (ANALYSIS, FINAL, [])),
}


@pytest.mark.parametrize(("reasoning", "tools"), REPLIES)
def test_reasoning_then_tool_calls(reasoning, tools):
    text, expected = REPLIES[reasoning, tools]
    parsing = ReplyParsing(reasoning, "", ToolCallParsing(QwenToolCalls) if tools else None)
    assert parse_reply(parsing, text) == expected
    stream = parsing.stream()
    pieces = [p for ch in text for p in stream.feed(ch)] + stream.finish()
    assert _split(pieces) == expected
