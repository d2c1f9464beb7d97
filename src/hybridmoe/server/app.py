"""The FastAPI application: OpenAI-compatible routes over one Engine and its Scheduler."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from hybridmoe.engine import Engine
from hybridmoe.engine.stats import GenerationStats
from hybridmoe.server import responses
from hybridmoe.server.config import ServerConfig
from hybridmoe.server.errors import RequestTimedOut, generation_error, install_error_handlers
from hybridmoe.server.generation import Generation, ServedModel, start_chat, start_completion
from hybridmoe.server.limits import BodyLimit, RequestLimits, until_deadline
from hybridmoe.server.metrics import CONTENT_TYPE, MeteredBridge, ServerMetrics
from hybridmoe.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from hybridmoe.server.reasoning import resolve_reasoning
from hybridmoe.server.security import ApiKeyCheck, HostCheck, allowed_host_names
from hybridmoe.server.warmup import warm_up

DISCONNECT_POLL_S = 0.05  # how often a non-streaming request checks that its client is there


def create_app(
    engine: Engine,
    model_id: str,
    start_scheduler: bool = True,
    config: ServerConfig | None = None,
) -> FastAPI:
    """The app serving `engine` as `model_id` under `config`'s limits; `app.state.served.
    scheduler` is the engine's scheduler (its KV cache was allocated with the engine, before
    the server binds). With `start_scheduler` the app's lifespan warms the engine up and runs
    the scheduler on a background thread; without, the caller warms up (warmup.warm_up), calls
    mark_ready and runs `scheduler.run()` on a thread of its choice: until mark_ready, /health
    answers 503 "loading" and generation requests 503. The lifespan's end closes the
    scheduler; closing the engine stays the caller's job. Raises CheckpointError when
    `config.reasoning_format` does not fit the checkpoint."""
    config = config or ServerConfig()
    metrics = ServerMetrics(model_id, lambda: _stats_since_ready(app))
    reasoning, stop_ids = resolve_reasoning(engine.tokenizer, config.reasoning_format)
    bridge = MeteredBridge(metrics)
    served = ServedModel(model_id, engine, int(time.time()), bridge, reasoning, stop_ids)
    scheduler = served.scheduler

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.bridge.attach(asyncio.get_running_loop())
        if start_scheduler:
            mark_ready(app, warm_up(engine))
            scheduler.start()
        try:
            yield
        finally:
            scheduler.close()

    app = FastAPI(title="hybridmoe", lifespan=lifespan)
    app.state.served, app.state.metrics, app.state.baseline = served, metrics, None
    app.state.limits = RequestLimits(config, scheduler)
    install_error_handlers(app)
    _add_routes(app)
    _add_middleware(app, config)
    return app


def _add_middleware(app: FastAPI, config: ServerConfig) -> None:
    # The last added runs first: the Host check, then the key, then the body is read.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=config.api_key)
    allowed = allowed_host_names(config)
    if allowed is not None:
        app.add_middleware(HostCheck, allowed=allowed)


def mark_ready(app: FastAPI, baseline: GenerationStats | None = None) -> None:
    """The engine is warm: /health says ok and requests are admitted from now on; stats and
    metrics count from `baseline` (default: now)."""
    app.state.baseline = baseline or app.state.served.scheduler.stats()
    app.state.limits.ready.set()


def _stats_since_ready(app: FastAPI) -> GenerationStats:
    stats = app.state.served.scheduler.stats()
    return stats if app.state.baseline is None else stats.since(app.state.baseline)


def _served(request: Request) -> ServedModel:
    return request.app.state.served


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        if not request.app.state.limits.ready.is_set():
            return JSONResponse({"status": "loading"}, 503)
        alive = _served(request).scheduler.alive
        return JSONResponse(
            {"status": "ok" if alive else "scheduler stopped"}, 200 if alive else 503
        )

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        return ModelList(data=[_card(_served(request))])

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> ModelCard:
        served = _served(request)
        served.check_name(model_id)
        return _card(served)

    # Plain `def`s: FastAPI runs them in a worker thread, so waiting for the step lock never
    # blocks the event loop.
    @app.get("/v1/stats")
    def stats(request: Request) -> dict[str, Any]:
        return stats_body(_served(request), request.app.state.baseline)

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        served, limits = _served(request), request.app.state.limits
        deadline = limits.deadline()
        # Off the event loop: tokenising a long prompt must not stall every other client.
        generation = await run_in_threadpool(limits.admitted, start_completion, served, body)
        if body.stream:
            chunks = responses.completion_chunks(generation, served.id, body.include_usage)
            return _event_stream(chunks, generation, limits, deadline)
        whole = responses.completion_body(generation, served.id)
        return await _unless_disconnected(request, whole, deadline, limits.timeout_s)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        served, limits = _served(request), request.app.state.limits
        deadline = limits.deadline()
        generation = await run_in_threadpool(limits.admitted, start_chat, served, body)
        if body.stream:
            chunks = responses.chat_chunks(generation, served.id, body.include_usage)
            return _event_stream(chunks, generation, limits, deadline)
        whole = responses.chat_body(generation, served.id)
        return await _unless_disconnected(request, whole, deadline, limits.timeout_s)


def _card(served: ServedModel) -> ModelCard:
    return ModelCard(id=served.id, created=served.created)


def _event_stream(
    chunks: AsyncIterator[BaseModel],
    generation: Generation,
    limits: RequestLimits,
    deadline: float | None,
) -> responses.EventStream:
    return responses.EventStream(until_deadline(chunks, deadline, limits.timeout_s), generation)


async def _unless_disconnected(
    request: Request,
    body: Awaitable[BaseModel],
    deadline: float | None = None,
    timeout_s: float | None = None,
) -> Response:
    """`body` as JSON; if the client goes away first, the generation is cancelled (which frees
    its row) and nobody is answered. uvicorn does not cancel a handler whose client left. Past
    `deadline` (event-loop time) the generation is cancelled and the answer is a 504."""
    task = asyncio.ensure_future(body)
    loop = asyncio.get_running_loop()
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                return Response(status_code=499)  # nginx's "client closed request"; never sent
            if deadline is not None and timeout_s is not None and loop.time() >= deadline:
                return generation_error(RequestTimedOut(timeout_s)).response()
        if task.exception() is not None:
            return generation_error(task.exception()).response()
        return JSONResponse(task.result().model_dump(mode="json"))
    finally:
        task.cancel()  # no effect once done; else ends the generation (shutdown, disconnect)


def stats_body(served: ServedModel, baseline: GenerationStats | None = None) -> dict[str, Any]:
    """Serving counters since start (since `baseline`, the warm-up's end, when given);
    `experts` only when the decode target uses the expert cache or the CPU (hit rate, share of
    routes computed on the CPU, experts fetched/token)."""
    s: GenerationStats = served.scheduler.stats()
    s = s if baseline is None else s.since(baseline)
    return {
        "model": served.id,
        "uptime_s": round(time.time() - served.created, 3),
        "requests_served": s.requests_served,
        "requests_failed": s.requests_failed,
        "requests_cancelled": s.requests_cancelled,
        "requests_running": s.requests_running,
        "requests_waiting": s.requests_waiting,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "decode_tokens": s.decode_tokens,
        "decode_steps": s.decode_steps,
        "decode_s": round(s.decode_s, 6),
        "decode_tokens_per_s": round(s.decode_tok_per_s, 2),
        "mean_decode_batch": round(s.mean_batch, 2),
        "max_batch": served.scheduler.max_batch,
        "max_seq_len": served.scheduler.max_seq_len,
        "decode_target": served.engine.config.offload.decode_target,
        "experts": _expert_stats(s),
        "prefix_cache": _prefix_cache_stats(s),
    }


def _prefix_cache_stats(s: GenerationStats) -> dict[str, float] | None:
    """Blocks of the prefix cache, and prompt tokens it held of those looked up; None when off."""
    p = s.prefix_cache
    if p is None:
        return None
    return {
        "blocks_total": p.blocks_total,
        "blocks_used": p.blocks_used,
        "hit_tokens": p.hit_tokens,
        "queried_tokens": p.queried_tokens,
        "hit_rate": round(p.hit_rate, 4),
    }


def _expert_stats(s: GenerationStats) -> dict[str, float] | None:
    e = s.experts
    if e is None:
        return None
    return {
        "hit_rate": round(e.hit_rate, 4),
        "cpu_route_share": round(e.cpu_routes / e.routes, 4) if e.routes else 0.0,
        "fetched_per_token": round(e.fetched / s.decode_tokens, 4) if s.decode_tokens else 0.0,
    }
