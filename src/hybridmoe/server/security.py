"""Who may talk to the server: the Host header check against DNS rebinding and the API key.
Both are plain ASGI middleware that answer in OpenAI's error shape before the app runs."""

from __future__ import annotations

import hmac
import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from hybridmoe.server.config import ServerConfig
from hybridmoe.server.errors import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
OPEN_PATHS = ("/health",)  # load balancers probe it by IP: no Host check, no key
WILDCARD_HOSTS = ("0.0.0.0", "::")  # bound to every interface: its names are unknown


def allowed_host_names(config: ServerConfig) -> frozenset[str] | None:
    """The Host header names (without port, lower case) the server answers; None: any.
    --allowed-hosts when given ('*': any); else the --host it is bound to, plus the loopback
    names when that is a loopback address; a wildcard bind accepts any name."""
    if "*" in config.allowed_hosts:
        return None
    if config.allowed_hosts:
        return frozenset(name.lower() for name in config.allowed_hosts)
    host = config.host.lower()
    if host in WILDCARD_HOSTS:
        return None
    names = {f"[{host}]" if ":" in host else host}
    if host == "localhost" or _is_loopback_address(host):
        names.update(LOOPBACK_NAMES)
    return frozenset(names)


def _is_loopback_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """'Example.com:8000' -> 'example.com', '[::1]:8000' -> '[::1]'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class HostCheck:
    """Refuses (421) an HTTP request whose Host header names a host not in `allowed`: a page
    on another site that rebinds its DNS name to 127.0.0.1 cannot reach a loopback server."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = _header(scope, b"host")
            if header is None or host_name(header) not in self.allowed:
                error = ApiError(
                    421,
                    f"this server does not answer for the host {header!r}; it answers "
                    f"{', '.join(sorted(self.allowed))} (start it with --allowed-hosts to "
                    f"add names)",
                    code="misdirected_request",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ApiKeyCheck:
    """Refuses (401) a /v1 request without 'Authorization: Bearer <api_key>'."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self._expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = (_header(scope, b"authorization") or "").encode("latin-1")
            if not hmac.compare_digest(given, self._expected):
                error = ApiError(
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>' with the "
                    "key the server was started with (--api-key)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
