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

from hybridmoe.engine import Engine
from hybridmoe.engine.stats import GenerationStats
from hybridmoe.server import responses
from hybridmoe.server.errors import generation_error, install_error_handlers
from hybridmoe.server.generation import ServedModel, start_chat, start_completion
from hybridmoe.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

DISCONNECT_POLL_S = 0.05  # how often a non-streaming request checks that its client is there


def create_app(engine: Engine, model_id: str, start_scheduler: bool = True) -> FastAPI:
    """The app serving `engine` as `model_id`; `app.state.served.scheduler` is the engine's
    scheduler (its KV cache was allocated with the engine, before the server binds).
    With `start_scheduler` the app's lifespan runs the scheduler on a background thread;
    without, the caller runs `scheduler.run()` on a thread of its choice. The lifespan's end
    closes the scheduler; closing the engine stays the caller's job."""
    served = ServedModel(model_id, engine, created=int(time.time()))
    scheduler = served.scheduler

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.bridge.attach(asyncio.get_running_loop())
        if start_scheduler:
            scheduler.start()
        try:
            yield
        finally:
            scheduler.close()

    app = FastAPI(title="hybridmoe", lifespan=lifespan)
    app.state.served = served
    install_error_handlers(app)
    _add_routes(app)
    return app


def _served(request: Request) -> ServedModel:
    return request.app.state.served


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        alive = _served(request).scheduler.alive
        return JSONResponse(
            {"status": "ok" if alive else "scheduler stopped"}, 200 if alive else 503
        )

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        served = _served(request)
        return ModelList(data=[ModelCard(id=served.id, created=served.created)])

    # A plain `def`: FastAPI runs it in a worker thread, so waiting for the step lock never
    # blocks the event loop.
    @app.get("/v1/stats")
    def stats(request: Request) -> dict[str, Any]:
        return stats_body(_served(request))

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        served = _served(request)
        generation = start_completion(served, body)
        if body.stream:
            chunks = responses.completion_chunks(generation, served.id, body.include_usage)
            return responses.EventStream(chunks, generation)
        whole = responses.completion_body(generation, served.id)
        return await _unless_disconnected(request, whole)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        served = _served(request)
        generation = start_chat(served, body)
        if body.stream:
            chunks = responses.chat_chunks(generation, served.id, body.include_usage)
            return responses.EventStream(chunks, generation)
        whole = responses.chat_body(generation, served.id)
        return await _unless_disconnected(request, whole)


async def _unless_disconnected(request: Request, body: Awaitable[BaseModel]) -> Response:
    """`body` as JSON; if the client goes away first, the generation is cancelled (which frees
    its row) and nobody is answered. uvicorn does not cancel a handler whose client left."""
    task = asyncio.ensure_future(body)
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                return Response(status_code=499)  # nginx's "client closed request"; never sent
        if task.exception() is not None:
            return generation_error(task.exception()).response()
        return JSONResponse(task.result().model_dump(mode="json"))
    finally:
        task.cancel()  # no effect once done; else ends the generation (shutdown, disconnect)


def stats_body(served: ServedModel) -> dict[str, Any]:
    """Serving counters since start; `experts` only when the decode target uses the expert
    cache or the CPU (hit rate, share of routes computed on the CPU, experts fetched/token)."""
    s: GenerationStats = served.scheduler.stats()
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
