"""One SGLang server as a child of a worker: find its venv, start it, talk to it, stop it.

The server runs from the SGLang venv in its own process group under rlcore's
guard (:mod:`rlcore.runtime.guard`, through :class:`rlcore.runtime.server.GuardedServer`),
which ends the whole group (SGLang's scheduler and detokenizer processes included)
when the server exits, when it is told to stop, or when the worker that started it
dies without cleaning up (``ray.kill``, a crash).

The server binds 127.0.0.1 when the run is on one node. Its weight-update routes change
the model, so when a reader is on another node (``InitContext.network``) it binds the
node's address and SGLang's own key check guards every route but ``/health`` with the
run's token (401 without).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rlcore.runtime.server import GuardedServer, ServerError, find_venv_python

__all__ = ["ServerError", "ServerProcess", "find_sglang_python"]

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
PACKAGE_DIR = Path(__file__).resolve().parent
#: Put first on the server's PYTHONPATH: its sitecustomize runs in every server process.
SITE_DIR = PACKAGE_DIR / "site"
INSTALL_HINT = "bash install.sh --sglang (it makes .venv-sglang; --all makes every venv), or see plugins/sglang/README.md"


def find_sglang_python(option: str | None) -> Path:
    """The SGLang venv's python: the option, else ``$RLCORE_SGLANG_PYTHON``, else
    ``.venv-sglang`` beside the running venv or in a parent directory of this package.

    Raises :class:`ConfigError` naming ``generation.options.python`` and the install command.
    """
    return find_venv_python(
        option,
        key="generation.options.python",
        env_var="RLCORE_SGLANG_PYTHON",
        venv=".venv-sglang",
        package_dir=PACKAGE_DIR,
        needs="backend 'sglang' needs the SGLang venv",
        install_hint=INSTALL_HINT,
    )


class ServerProcess(GuardedServer):
    """One SGLang server (``sglang.launch_server``) started by the current process.

    Args:
        python: the SGLang venv's python.
        args: ``sglang.launch_server`` arguments; ``--host`` and ``--port`` are added here.
        port: the port to bind.
        log_path: where the server's stdout and stderr go.
        env: extra environment variables of the server.
        host: the address to bind (loopback unless a reader is on another node).
        token: the run's token; then SGLang's own key check guards every route but
            ``/health``: the token is both ``--api-key`` and ``--admin-api-key`` (its
            weight-update routes want the admin key; with none set they would be 403).
    """

    def __init__(
        self,
        python: Path,
        args: list[str],
        *,
        port: int,
        log_path: Path,
        env: dict[str, str],
        host: str = HOST,
        token: str | None = None,
    ) -> None:
        path = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH", "")) if p)
        keys = ["--api-key", token, "--admin-api-key", token] if token else []
        super().__init__(
            [str(python), "-m", "sglang.launch_server", *args, *keys],
            port=port, log_path=log_path, env={**env, "PYTHONPATH": path}, host=host, token=token,
            what="SGLang server",
        )
