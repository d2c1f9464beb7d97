"""`hybridmoe chat`: a conversation on the terminal. A reasoning model's thinking (harmony's
analysis channel, a <think> block; server/reasoning.py, chosen by the chat template) goes to
stderr as it comes, its answer to stdout, and only the answer is the reply's content in the
history."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator

from hybridmoe.engine import Engine, SamplingParams
from hybridmoe.server.reasoning import AUTO, Reasoning, ReasoningStream, resolve_reasoning


def chat_loop(engine: Engine, system: str | None, params: SamplingParams) -> None:
    """Read user turns from stdin until EOF or /exit, answering each with the whole chat."""
    reasoning, stop_ids = resolve_reasoning(engine.tokenizer, AUTO)
    if reasoning is not None:
        params = dataclasses.replace(
            params,
            stop_token_ids=params.stop_token_ids | stop_ids,
            skip_special_tokens=not reasoning.keeps_special_tokens,
        )
    messages = [{"role": "system", "content": system}] if system else []
    print("chat: type a message, /exit or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if user.strip() in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": user})
        prompt = engine.require_tokenizer().apply_chat_template(messages)
        parser = reasoning.stream(prompt) if reasoning is not None else None
        # the template already holds every special token the model expects
        ids = engine.encode(prompt, add_special_tokens=False)
        thought, content = stream_reply(engine.stream(ids, params), parser)
        print(engine.stats.summary(), file=sys.stderr)
        reply = {"role": "assistant", "content": content}
        messages.append(reply | ({"reasoning_content": thought} if thought else {}))


def stream_reply(
    texts: Iterator[str],
    parser: ReasoningStream | None,
    show: Callable[[str, bool], None] | None = None,
) -> tuple[str, str]:
    """(reasoning, content) of a reply's streamed `texts`, each piece shown as it is decided
    (`show(text, is_reasoning)`; default: reasoning to stderr, content to stdout)."""
    show = show or _show
    thought, content = [], []
    for text in texts:
        for piece in parser.feed(text) if parser is not None else [text]:
            _take(piece, thought, content, show)
    for piece in parser.finish() if parser is not None else []:
        _take(piece, thought, content, show)
    show("\n", False)
    return "".join(thought), "".join(content)


def _take(piece: object, thought: list[str], content: list[str], show) -> None:
    if isinstance(piece, Reasoning):
        thought.append(piece.text)
        show(piece.text, True)
    elif isinstance(piece, str):
        content.append(piece)
        show(piece, False)
    else:  # a tool call: this chat offers no tools, so the model made it up
        show(f"[a call the chat cannot run: {piece}]", True)


def _show(text: str, is_reasoning: bool) -> None:
    stream = sys.stderr if is_reasoning else sys.stdout
    stream.write(text)
    stream.flush()
