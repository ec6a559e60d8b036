"""vLLM's OpenAI-compatible server as a child of a worker: start, talk to, stop.

The server runs in its own process group under rlcore's guard
(:mod:`rlcore.runtime.guard`, through :class:`rlcore.runtime.server.GuardedServer`):
if the worker that started it dies without cleaning up (``ray.kill``, a crash), the
guard ends the whole group, the server's engine-core process included. vLLM's
server does not do that by itself: killing it leaves its engine core running.

The server runs with ``VLLM_SERVER_DEV_MODE=1`` (which adds the weight-transfer
and cache routes refit needs, and others such as ``/collective_rpc``). It binds
127.0.0.1 when the run is on one node; when a reader is on another node
(``InitContext.network``) it binds the node's address and every route but
``/health`` wants the run's token (rlcore's :class:`rlcore.serve.auth.BearerGuard`
as vLLM middleware: vLLM's own ``--api-key`` guards ``/v1`` only, not the dev routes).
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlcore.config.placement import TOKEN_ENV
from rlcore.runtime.server import GuardedServer, ServerError

__all__ = ["ServerError", "ServerProcess"]


class ServerProcess(GuardedServer):
    """One vLLM OpenAI-compatible server, started by the current process.

    Args:
        vllm_args: arguments of ``vllm.entrypoints.openai.api_server`` (``--model``...);
            ``--host`` and ``--port`` are added here.
        port: the port to bind.
        log_path: where the server's stdout and stderr go.
        env: extra environment variables of the server.
        host: the address to bind (loopback unless a reader is on another node).
        token: the run's token; required off loopback, then checked on every route.
    """

    def __init__(
        self,
        vllm_args: list[str],
        *,
        port: int,
        log_path: Path,
        env: dict[str, str],
        host: str = "127.0.0.1",
        token: str | None = None,
    ) -> None:
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_args]
        if token:
            # vLLM's --api-key guards /v1 only; the middleware guards the refit routes too.
            command += ["--middleware", "rlcore.serve.auth.BearerGuard"]
            env = {**env, TOKEN_ENV: token}
        super().__init__(
            command, port=port, log_path=log_path, env=env, host=host, token=token, what="vLLM server"
        )
