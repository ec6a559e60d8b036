"""The run's token check for HTTP servers bound beyond loopback (:class:`rlcore.config.placement.Network`).

:class:`BearerGuard` is plain ASGI middleware: every request but ``GET /health`` must
carry ``Authorization: Bearer <token>``, else it is answered 401 before the app sees it.
Unlike vLLM's own ``--api-key`` (which guards ``/v1`` only), it guards every route: a
server started for refit also serves weight-update and RPC routes. rlcore's endpoint adds
it itself; a server process started by a backend adds it by import path
(``--middleware rlcore.serve.auth.BearerGuard`` for vLLM), and it then reads the token
from :data:`rlcore.config.placement.TOKEN_ENV`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

from rlcore.config.placement import TOKEN_ENV

#: Routes answered without a token: liveness only, it reveals nothing.
OPEN_PATHS = frozenset({"/health"})


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``token`` (constant-time compare)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(_digest(given.strip()), _digest(token))


class BearerGuard:
    """ASGI middleware: 401 for a request without the run's bearer token.

    Args:
        app: the ASGI app behind it.
        token: the token; ``None`` reads :data:`rlcore.config.placement.TOKEN_ENV`, and a
            guard without any token refuses to start (a guard that lets all in is a bug).
    """

    def __init__(self, app: Any, token: str | None = None) -> None:
        token = token or os.environ.get(TOKEN_ENV)
        if not token:
            raise RuntimeError(f"BearerGuard needs a token (argument or ${TOKEN_ENV})")
        self.app = app
        self._token = token

    def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]], send: Callable[..., Awaitable[Any]]) -> Awaitable[None]:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS:
            return self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if authorized(headers.get("authorization"), self._token):
            return self.app(scope, receive, send)
        return _unauthorized(scope, send)


async def _unauthorized(scope: dict[str, Any], send: Callable[..., Awaitable[Any]]) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    message = "missing or wrong bearer token (Authorization: Bearer <the run's token>)"
    body = json.dumps({"object": "error", "message": message, "type": "AuthenticationError", "code": 401,
                       "error": {"message": message, "code": 401}}).encode()
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
        (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
