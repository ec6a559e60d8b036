"""An HTTP server a worker starts as a child: start it under a guard, wait until it
answers, talk JSON to it, stop its whole process group.

Engines with their own server (vLLM's OpenAI-compatible server, SGLang's) subclass
:class:`GuardedServer` with their command line. The server runs under
:mod:`rlcore.runtime.guard`, so it ends with the worker that started it even when
that worker is killed. It binds loopback unless told otherwise; bound beyond
loopback it needs the run's token, and every request this class makes carries it.
:func:`find_venv_python` finds the python of a server kept in a venv of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcore.errors import ConfigError, RlcoreError
from rlcore.runtime.addresses import is_loopback
from rlcore.runtime.proc import log_tail, stop_group


class ServerError(RlcoreError):
    """A server failed to start, died, or answered a request with an error.

    Attributes:
        status: the HTTP status of a rejected request (None: no answer).
        message: the server's own message (its JSON answer's ``message``, else the body).
    """

    def __init__(self, text: str, *, status: int | None = None, message: str = "") -> None:
        super().__init__(text)
        self.status = status
        self.message = message


def find_venv_python(
    option: str | None,
    *,
    key: str,
    env_var: str,
    venv: str,
    package_dir: Path,
    needs: str,
    install_hint: str,
    point_at: str = "its python",
) -> Path:
    """A venv's python: ``option``, else ``$env_var``, else ``<venv>/bin/python`` beside the
    running venv or in a parent directory of ``package_dir`` (a source checkout).

    Raises :class:`ConfigError` naming the option ``key``: ``"<needs>, but <where> has no
    python there (looked at ...). Install it with <install_hint>, or point <key> (or
    $<env_var>) at <point_at>"``.
    """
    if option:
        candidates, where = [Path(option).expanduser()], key
    elif os.environ.get(env_var):
        candidates, where = [Path(os.environ[env_var]).expanduser()], f"${env_var}"
    else:
        where = "the default"
        roots = [Path(sys.prefix).parent, *package_dir.parents]
        candidates = [r / venv / "bin" / "python" for r in dict.fromkeys(roots)]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise ConfigError(
        f"{needs}, but {where} has no python there "
        f"(looked at {', '.join(str(c) for c in candidates[:3])}). Install it with {install_hint}, "
        f"or point {key} (or ${env_var}) at {point_at}",
        key=key,
    )


class GuardedServer:
    """One server process group, started by the current process.

    Args:
        command: the server's command line; ``--host`` and ``--port`` are added here.
        port: the port to bind.
        log_path: where the server's stdout and stderr go.
        env: extra environment variables of the server.
        host: the address to bind (loopback unless a reader is on another node).
        token: the run's token: required beyond loopback, sent with every request.
        what: the server's name in errors and logs (``vLLM server``).
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        port: int,
        log_path: Path,
        env: dict[str, str],
        host: str = "127.0.0.1",
        token: str | None = None,
        what: str = "server",
    ) -> None:
        if not is_loopback(host) and not token:
            raise ServerError(f"{what} on {host}, beyond loopback, needs the run's token")
        self.what = what
        self.port = port
        self.host = host
        self.token = token
        self.base = f"http://{host}:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        guard = [sys.executable, "-m", "rlcore.runtime.guard", "--watch-pid", str(os.getpid()), "--"]
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [*guard, *command, "--host", host, "--port", str(port)],
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() signals all of it
            )
        self.pgid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float, cancel: Any = None, *, path: str = "/health") -> float:
        """Poll ``path`` until it answers 200; returns seconds waited.

        Raises :class:`ServerError` with the end of the server's log if it exits or is
        not ready within ``timeout_s``; observes ``cancel`` (a
        :class:`rlcore.errors.CancelToken`) between polls.
        """
        t0 = time.monotonic()
        while True:
            if not self.alive():
                raise ServerError(
                    f"{self.what} exited with code {self.proc.returncode} during start; "
                    f"end of its log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base + path, timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise ServerError(
                    f"{self.what} on port {self.port} not ready after {timeout_s:g}s; "
                    f"end of its log {self.log_path}:\n{self.log_tail()}"
                )
            if cancel is not None:
                cancel.raise_if_cancelled()
            time.sleep(0.25)

    def request(
        self, path: str, body: dict[str, Any] | None = None, *, timeout_s: float = 300.0
    ) -> Any:
        """POST JSON ``body`` to ``path`` (GET when it is None); the decoded JSON answer (its
        text where it is not JSON).

        Raises :class:`ServerError` with the server's message on an HTTP error, and
        naming the exit code and the log's end when the server is gone.
        """
        method = "GET" if body is None else "POST"
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **self.auth_headers()}
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:4000]
            try:
                message = str(json.loads(detail).get("message", detail))
            except (ValueError, AttributeError):
                message = detail
            raise ServerError(
                f"{self.what} {self.base}: {method} {path} answered HTTP {err.code}: {message}",
                status=err.code, message=message,
            ) from None
        except (urllib.error.URLError, OSError) as err:
            if not self.alive():
                raise ServerError(
                    f"{self.what} {self.base} is gone (exit code {self.proc.returncode}) "
                    f"during {path}; end of its log {self.log_path}:\n{self.log_tail()}"
                ) from None
            raise ServerError(f"{self.what} {self.base}: {method} {path} failed: {err}") from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:  # a route that answers in words (vLLM's /v1/load_lora_adapter)
            return raw.decode(errors="replace")

    def post(self, path: str, body: dict[str, Any] | None = None, *, timeout_s: float = 300.0) -> Any:
        """POST ``body`` (an empty JSON object when None) to ``path``: see :meth:`request`."""
        return self.request(path, {} if body is None else body, timeout_s=timeout_s)

    def auth_headers(self) -> dict[str, str]:
        """The ``Authorization`` header this server wants, or {} without a token."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def stop(self, grace_s: float = 5.0) -> None:
        """End the whole process group: SIGTERM, then SIGKILL after ``grace_s``. Idempotent."""
        stop_group(self.pgid, grace_s, reap=[self.proc], what=self.what)
