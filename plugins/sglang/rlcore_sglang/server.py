"""One SGLang server as a child of a worker: find its venv, start it, talk to it, stop it.

The server runs in its own process group under a small guard
(``python -m rlcore_sglang.server --watch-pid PID -- <sglang python> <args>``):
the guard starts ``sglang.launch_server`` from the SGLang venv and ends the
whole group (SGLang's scheduler and detokenizer processes included) when the
server exits, when it is told to stop, or when the worker ``PID`` that started
it dies without cleaning up (``ray.kill``, a crash). The guard forks once so it
is the worker's grandchild: Ray kills a dying worker's direct children, not
their descendants.

The server binds 127.0.0.1 only; its weight-update routes change the model, so
never expose it beyond the host.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rlcore.errors import ConfigError, RlcoreError
from rlcore.runtime.proc import log_tail, signal_group, stop_group

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
PACKAGE_DIR = Path(__file__).resolve().parent
#: Put first on the server's PYTHONPATH: its sitecustomize runs in every server process.
SITE_DIR = PACKAGE_DIR / "site"
INSTALL_HINT = "bash install.sh (it makes .venv-sglang), or see plugins/sglang/README.md"


class ServerError(RlcoreError):
    """An SGLang server failed to start, died, or answered a request with an error.

    Attributes:
        status: the HTTP status of a rejected request (None: no answer).
        message: the server's own message (``message`` field of its JSON answer).
    """

    def __init__(self, text: str, *, status: int | None = None, message: str = "") -> None:
        super().__init__(text)
        self.status = status
        self.message = message


def find_sglang_python(option: str | None) -> Path:
    """The SGLang venv's python: the option, else ``$RLCORE_SGLANG_PYTHON``, else
    ``.venv-sglang`` beside the running venv or in a parent directory of this package.

    Raises :class:`ConfigError` naming ``generation.options.python`` and the install command.
    """
    if option:
        candidates, where = [Path(option).expanduser()], "generation.options.python"
    elif os.environ.get("RLCORE_SGLANG_PYTHON"):
        candidates = [Path(os.environ["RLCORE_SGLANG_PYTHON"]).expanduser()]
        where = "$RLCORE_SGLANG_PYTHON"
    else:
        where = "the default"
        roots = [Path(sys.prefix).parent, *PACKAGE_DIR.parents]
        candidates = [r / ".venv-sglang" / "bin" / "python" for r in dict.fromkeys(roots)]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise ConfigError(
        f"backend 'sglang' needs the SGLang venv, but {where} has no python there "
        f"(looked at {', '.join(str(c) for c in candidates[:3])}). Install it with {INSTALL_HINT}, "
        "or point generation.options.python (or $RLCORE_SGLANG_PYTHON) at its python",
        key="generation.options.python",
    )


class ServerProcess:
    """One SGLang server (``sglang.launch_server``) started by the current process.

    Args:
        python: the SGLang venv's python.
        args: ``sglang.launch_server`` arguments; ``--host`` and ``--port`` are added here.
        port: the port to bind.
        log_path: where the server's stdout and stderr go.
        env: extra environment variables of the server.
    """

    def __init__(
        self, python: Path, args: list[str], *, port: int, log_path: Path, env: dict[str, str]
    ) -> None:
        self.port = port
        self.base = f"http://{HOST}:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "rlcore_sglang.server", "--watch-pid", str(os.getpid()), "--"]
        cmd += [str(python), "-m", "sglang.launch_server", *args, "--host", HOST, "--port", str(port)]
        path = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH", "")) if p)
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                env={**os.environ, **env, "PYTHONPATH": path},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() signals all of it
            )
        self.pgid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float, cancel: Any = None) -> float:
        """Poll ``/health_generate`` until it answers 200; returns seconds waited.

        Raises :class:`ServerError` naming SGLang with the end of its log if the
        server exits or is not ready within ``timeout_s``; observes ``cancel``
        (an :class:`rlcore.waiting.CancelToken`) between polls.
        """
        t0 = time.monotonic()
        while True:
            if not self.alive():
                raise ServerError(
                    f"SGLang server exited with code {self.proc.returncode} during start; "
                    f"end of its log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise ServerError(
                    f"SGLang server on port {self.port} not ready after {timeout_s:g}s; "
                    f"end of its log {self.log_path}:\n{self.log_tail()}"
                )
            if cancel is not None:
                cancel.raise_if_cancelled()
            time.sleep(0.25)

    def request(
        self, path: str, body: dict[str, Any] | None = None, *, timeout_s: float = 300.0
    ) -> Any:
        """POST JSON to ``path`` (GET when ``body`` is None); the decoded JSON answer.

        Raises :class:`ServerError` with the server's message on an HTTP error, and
        naming SGLang's exit code and log tail when the server is gone.
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base + path, data=data, headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
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
                f"SGLang server {self.base}: {path} answered HTTP {err.code}: {message}",
                status=err.code, message=message,
            ) from None
        except (urllib.error.URLError, OSError) as err:
            if not self.alive():
                raise ServerError(
                    f"SGLang server {self.base} is gone (exit code {self.proc.returncode}) "
                    f"during {path}; end of its log {self.log_path}:\n{self.log_tail()}"
                ) from None
            raise ServerError(f"SGLang server {self.base}: {path} failed: {err}") from None
        return json.loads(raw) if raw else None

    def log_tail(self, n: int = 30) -> str:
        return log_tail(self.log_path, n)

    def stop(self, grace_s: float = 5.0) -> None:
        """End the whole process group: SIGTERM, then SIGKILL after ``grace_s``. Idempotent."""
        stop_group(self.pgid, grace_s, reap=[self.proc], what="SGLang server")


# ------------------------------------------------------------------------ guard


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _guard(watch_pid: int, cmd: list[str]) -> int:
    """Run ``cmd``; end the process group when it exits, on SIGTERM/SIGINT, or when
    ``watch_pid`` dies."""
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen(cmd)
    rc: int | None = None
    while rc is None and not stop and _pid_alive(watch_pid):
        time.sleep(0.2)
        rc = child.poll()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pgid = os.getpgrp()
    signal_group(pgid, signal.SIGTERM)
    try:
        child.wait(5.0)
    except subprocess.TimeoutExpired:
        pass
    signal_group(pgid, signal.SIGKILL)  # whatever is left, this process included
    return rc or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[0] != "--watch-pid" or argv[2] != "--":
        print("usage: python -m rlcore_sglang.server --watch-pid PID -- CMD...", file=sys.stderr)
        return 2
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)
    guard = os.fork()
    if guard == 0:  # the guard: the worker's grandchild (see the module doc)
        code = 1
        try:
            code = _guard(int(argv[1]), argv[3:])
        finally:
            os._exit(code)
    _, status = os.waitpid(guard, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
