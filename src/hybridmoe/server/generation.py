"""From an OpenAI request to a scheduled generation: the prompt's token ids, the sampling
parameters, the context-window check, and the bridge from the scheduler thread to the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from hybridmoe.engine import Engine, SamplingParams
from hybridmoe.engine.constraints import Grammar, GrammarError
from hybridmoe.engine.scheduler import RequestOutput, Scheduler, SchedulerClosed
from hybridmoe.errors import CheckpointError
from hybridmoe.server.errors import ApiError, generation_error
from hybridmoe.server.limits import check_prompt_chars
from hybridmoe.server.logprobs import TokenText
from hybridmoe.server.protocol import ChatCompletionRequest, CompletionRequest
from hybridmoe.server.reasoning import ReasoningFormat
from hybridmoe.server.reply import ReplyParsing
from hybridmoe.server.structured import plan_chat

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OutputBridge:
    """Hands scheduler outputs to the event loop. Every output of one scheduler step crosses
    threads in a single wake-up of the loop, not one per request: at 8 clients that is 8x
    fewer self-pipe writes and loop iterations competing with the decode thread for the GIL."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, RequestOutput]] = []

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver into `loop` from now on (the server's, once it runs)."""
        self._loop = loop

    def sender(self, queue: asyncio.Queue) -> Callable[[RequestOutput], None]:
        """A scheduler callback (any thread) that puts each output into `queue`."""
        return lambda output: self._send(queue, output)

    def _send(self, queue: asyncio.Queue, output: RequestOutput) -> None:
        with self._lock:
            self._pending.append((queue, output))
            if len(self._pending) > 1:
                return  # a flush is already scheduled and will take this one too
        if self._loop is None:
            raise RuntimeError("OutputBridge.attach was never called")
        self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, output in pending:
            queue.put_nowait(output)


@dataclass(frozen=True)
class ServedModel:
    """The one model this server serves, under the name clients ask for it by; chat replies'
    reasoning is split out in `reasoning`'s format, whose end-of-reply tokens are
    `reasoning_stop_ids` (reasoning.resolve_reasoning)."""

    id: str
    engine: Engine
    created: int  # unix time the server started
    bridge: OutputBridge = field(default_factory=OutputBridge)  # attached at app startup
    reasoning: ReasoningFormat | None = None
    reasoning_stop_ids: frozenset[int] = frozenset()

    @property
    def scheduler(self) -> Scheduler:
        """The engine's scheduler, which the server runs."""
        return self.engine.scheduler

    def check_name(self, name: str) -> None:
        if name != self.id:
            raise ApiError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.id}'",
                param="model",
                code="model_not_found",
            )


class Generation:
    """One request in flight, seen from the event loop: its outputs arrive in a queue.
    `reply` (chat with reasoning or tools) splits its text into reasoning, content and tool
    calls; `vocab` spells the tokens of its logprobs."""

    def __init__(
        self,
        engine: Engine,
        bridge: OutputBridge,
        prompt_ids: list[int],
        params: SamplingParams,
        reply: ReplyParsing | None = None,
    ) -> None:
        self.reply = reply
        self.vocab: TokenText | None = None
        if params.logprobs is not None:  # read before the request is queued: it may fail
            tokenizer = engine.require_tokenizer()
            self.vocab = TokenText(tokenizer.token_bytes(engine.model.cfg.vocab_size))
        self._outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._request = engine.submit(prompt_ids, params, bridge.sender(self._outputs))
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The outputs up to the last; raises the request's error if it failed. Outputs that
        queued up while the consumer was busy come merged into one. Leaving early (a client
        that disconnected cancels the task awaiting here) frees the request's row."""
        try:
            while True:
                output = await self._outputs.get()
                while not output.finished and not self._outputs.empty():
                    output = _merged(output, self._outputs.get_nowait())
                if output.error is not None:
                    raise output.error
                self.completion_tokens = output.completion_tokens
                yield output
                if output.finished:
                    return
        finally:
            self.cancel()

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held, once an output arrived (set at admission)."""
        return self._request.cached_tokens

    def cancel(self) -> None:
        """Free the request's row before the next step; no effect once it has finished."""
        self._request.cancel()


def _merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    return RequestOutput(
        first.text + then.text,
        then.completion_tokens,
        then.finish_reason,
        then.error,
        first.logprobs + then.logprobs,
    )


def start_completion(served: ServedModel, request: CompletionRequest) -> Generation:
    served.check_name(request.model)
    if isinstance(request.prompt, str):
        prompt_ids = _encode(served.engine, request.prompt, "prompt", add_special_tokens=True)
    else:
        prompt_ids = _checked_ids(served.engine, request.prompt)
    max_tokens = request.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
    fmt = request.response_format
    constraint = (fmt.grammar(), fmt.grammar_param) if fmt else (None, None)
    return _start(served, request, prompt_ids, max_tokens, "prompt", request.logprobs, constraint)


def start_chat(served: ServedModel, request: ChatCompletionRequest) -> Generation:
    served.check_name(request.model)
    messages = [message.template_dict() for message in request.messages]
    try:
        tokenizer = served.engine.require_tokenizer()
        source = tokenizer.chat_template.source if tokenizer.chat_template else ""
        plan = plan_chat(
            request.response_format,
            request.tools,
            request.tool_choice,
            request.parallel_tool_calls,
            source,
        )
        text = tokenizer.apply_chat_template(
            messages, tools=plan.template_tools, variables=request.template_variables
        )
    except (CheckpointError, ValueError) as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    # The rendered template already holds every special token the model expects.
    prompt_ids = _encode(served.engine, text, "messages", add_special_tokens=False)
    # Without a limit the completion may fill the rest of the context window.
    room = max(served.scheduler.max_seq_len - len(prompt_ids), 1)
    max_tokens = request.completion_limit or room
    logprobs = request.top_logprobs_count
    constraint = (plan.grammar, plan.grammar_param)
    reply = None
    if served.reasoning is not None or plan.tool_parsing is not None:
        reply = ReplyParsing(served.reasoning, text, plan.tool_parsing)
    return _start(served, request, prompt_ids, max_tokens, "messages", logprobs, constraint, reply)


def _start(
    served: ServedModel,
    request: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_tokens: int,
    prompt_field: str,
    logprobs: int | None,
    constraint: tuple[Grammar | None, str | None] = (None, None),
    reply: ReplyParsing | None = None,
) -> Generation:
    """`constraint`: the grammar the output must match, and the request field it came from;
    a `reply` with a reasoning format ends at its stop tokens and keeps the special tokens it
    reads."""
    _check_context(served.scheduler.max_seq_len, len(prompt_ids), max_tokens, prompt_field)
    grammar, grammar_param = constraint
    if grammar is not None and request.ignore_eos:
        raise ApiError(400, "ignore_eos cannot go with a constrained output", param="ignore_eos")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=request.stop_strings,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        grammar=grammar,
        **_reasoning_params(served, reply),
    )
    try:
        return Generation(served.engine, served.bridge, prompt_ids, params, reply)
    except GrammarError as exc:
        raise ApiError(400, f"invalid '{grammar_param}': {exc}", param=grammar_param) from exc
    except CheckpointError as exc:  # a vocabulary whose token bytes cannot be read
        param = grammar_param or "logprobs"
        raise ApiError(400, f"'{param}' is not available: {exc}", param=param) from exc
    except SchedulerClosed as exc:
        raise generation_error(exc) from exc


def _reasoning_params(served: ServedModel, reply: ReplyParsing | None) -> dict:
    reasoning = reply.reasoning if reply is not None else None
    if reasoning is None:
        return {}
    return {
        "stop_token_ids": served.reasoning_stop_ids,
        "skip_special_tokens": not reasoning.keeps_special_tokens,
    }


def _check_context(
    max_seq_len: int, prompt_tokens: int, max_tokens: int, prompt_field: str
) -> None:
    if prompt_tokens + max_tokens <= max_seq_len:
        return
    too_long = prompt_tokens >= max_seq_len
    raise ApiError(
        400,
        f"the context window is {max_seq_len} tokens, but {prompt_tokens + max_tokens} were "
        f"requested ({prompt_tokens} in the prompt, max_tokens {max_tokens}); shorten the "
        f"prompt or lower max_tokens",
        param=prompt_field if too_long else "max_tokens",
        code="context_length_exceeded",
    )


def _encode(engine: Engine, text: str, param: str, add_special_tokens: bool) -> list[int]:
    check_prompt_chars(engine, text, param)
    try:
        return engine.encode(text, add_special_tokens)
    except ValueError as exc:  # empty after tokenisation, or no tokenizer
        raise ApiError(400, str(exc), param=param) from exc


def _checked_ids(engine: Engine, ids: list[int]) -> list[int]:
    vocab_size = engine.model.cfg.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        message = f"token id {bad} is outside the vocabulary [0, {vocab_size})"
        raise ApiError(400, message, param="prompt")
    return ids
