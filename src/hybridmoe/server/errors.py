"""Errors as OpenAI's API reports them: a status code and {"error": {message, type, param, code}}.

FastAPI's own 422 for a body that fails validation becomes a 400 naming the field, and every
other failure keeps this shape, so an OpenAI client raises its usual exception classes.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hybridmoe.engine.scheduler import SchedulerClosed

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.kind, self.headers = code, kind, headers

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class RequestTimedOut(Exception):
    """A request ran past ServerConfig.request_timeout_s; it has been cancelled."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the request ran longer than the server's request timeout "
            f"(--request-timeout-s {timeout_s:g} s) and was cancelled"
        )


# The error type of a string with a lone UTF-16 surrogate (protocol.py); ctx["param"] names it.
LONE_SURROGATE = "lone_surrogate"


def generation_error(exc: Exception) -> ApiError:
    """A generation that ended in an error: 503 when the server is shutting down, else 500
    (logged: it is a fault of the server or the model, not of the request)."""
    if isinstance(exc, SchedulerClosed):
        return ApiError(503, "the server is shutting down", kind="server_error")
    if isinstance(exc, RequestTimedOut):
        return ApiError(504, str(exc), code="request_timeout", kind="timeout_error")
    log.error("generation failed", exc_info=exc)
    return ApiError(500, f"generation failed: {exc}", kind="server_error")


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first problem FastAPI found in a request body, as a 400 naming the field."""
    first = exc.errors()[0]
    path = [str(part) for part in first["loc"] if part != "body"]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", first["msg"])
        return ApiError(400, f"the request body is not valid JSON: {reason}")
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == LONE_SURROGATE:
        param = first["ctx"]["param"]
        return ApiError(400, f"invalid '{param}': {message}", param=param)
    if not path:
        return ApiError(400, f"the request body must be a JSON object: {message}")
    param = ".".join(path)
    return ApiError(400, f"invalid '{param}': {message}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return ApiError(exc.status_code, str(exc.detail), kind=kind).response()

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody to send it to (a read timeout closed it)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return generation_error(exc).response()
