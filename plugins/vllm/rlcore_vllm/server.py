"""vLLM's OpenAI-compatible server as a child of a worker: start, talk to, stop.

The server runs in its own process group under a small *launcher*
(``python -m rlcore_vllm.server --watch-pid PID -- <api_server args>``): a
guard process starts ``vllm.entrypoints.openai.api_server`` and, if the worker
that started it dies without cleaning up (``ray.kill``, a crash), terminates
the whole group, the server's engine-core process included. vLLM's server does
not do that by itself: killing it leaves its engine core running. The guard is
the worker's grandchild, because Ray kills a dying worker's direct children
(the launcher's stub) but not their descendants.

The server runs with ``VLLM_SERVER_DEV_MODE=1`` (which adds the weight-transfer
and cache routes refit needs, and others such as ``/collective_rpc``). It binds
127.0.0.1 when the run is on one node; when a reader is on another node
(``InitContext.network``) it binds the node's address and every route but
``/health`` wants the run's token (rlcore's :class:`rlcore.serve.auth.BearerGuard`
as vLLM middleware: vLLM's own ``--api-key`` guards ``/v1`` only, not the dev routes).
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

from rlcore.placement import TOKEN_ENV
from rlcore.runtime.proc import log_tail, signal_group, stop_group
from rlcore.runtime.workers import is_loopback

log = logging.getLogger(__name__)



class ServerError(RuntimeError):
    """The server failed to start or answered a request with an error."""


class ServerProcess:
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
        if not is_loopback(host) and not token:
            raise ServerError(f"vLLM server on {host}, beyond loopback, needs the run's token")
        self.port = port
        self.host = host
        self.token = token
        self.base = f"http://{host}:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "rlcore_vllm.server",
            "--watch-pid",
            str(os.getpid()),
            "--",
            *vllm_args,
            "--host",
            host,
            "--port",
            str(port),
        ]
        if token:
            cmd += ["--middleware", "rlcore.serve.auth.BearerGuard"]
            env = {**env, TOKEN_ENV: token}
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() signals all of it
            )
        self.pgid = self.proc.pid

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll ``/health`` until it answers 200; returns seconds waited.

        Raises :class:`ServerError` (with the end of the server's log) if the
        server exits or does not become healthy within ``timeout_s``.
        """
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"vLLM server exited with code {self.proc.returncode} during start; "
                    f"end of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise ServerError(
                    f"vLLM server on port {self.port} not healthy after {timeout_s:g}s; "
                    f"end of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def post(
        self, path: str, body: dict[str, Any] | None = None, *, timeout_s: float = 300.0
    ) -> Any:
        """POST JSON to ``path``; returns the decoded JSON answer or raises :class:`ServerError`."""
        data = json.dumps(body or {}).encode()
        headers = {"Content-Type": "application/json", **self.auth_headers()}
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            raise ServerError(f"vLLM server: POST {path} answered {err.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as err:
            raise ServerError(f"vLLM server: POST {path} failed: {err}") from None
        return json.loads(raw) if raw else None

    def auth_headers(self) -> dict[str, str]:
        """The ``Authorization`` header this server wants, or {} on loopback."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate the whole process group: SIGTERM, then SIGKILL after ``grace_s``. Idempotent."""
        stop_group(self.pgid, grace_s, reap=[self.proc], what="vLLM server")


# ------------------------------------------------------------------ launcher


def _watch(pid: int) -> Any:
    """A callable telling whether process ``pid`` is still running (pidfd where available)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return lambda: False
    except (AttributeError, OSError):  # no pidfd: poll with signal 0

        def alive() -> bool:
            try:
                os.kill(pid, 0)
                return True
            except ProcessLookupError:
                return False
            except PermissionError:
                return True

        return alive
    import select

    return lambda: not select.select([fd], [], [], 0)[0]  # readable once the process exited


def _guard(watch_pid: int, vllm_args: list[str]) -> int:
    """Run the server as a child; end the whole process group when it exits, when
    this process is asked to stop, or when the worker ``watch_pid`` dies."""
    worker_alive = _watch(watch_pid)
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_args]
    )
    rc: int | None = None
    while True:
        rc = child.poll()
        if rc is not None or stop or not worker_alive():
            break
        time.sleep(0.2)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pgid = os.getpgrp()
    signal_group(pgid, signal.SIGTERM)
    try:
        child.wait(5.0)
    except subprocess.TimeoutExpired:
        pass
    time.sleep(0.5)  # let the engine core finish its own SIGTERM handling
    signal_group(pgid, signal.SIGKILL)  # everything left, this process included
    return rc or 0


def _launch(watch_pid: int, vllm_args: list[str]) -> int:
    """Split into a stub (the worker's direct child) and a guard (its grandchild).

    Ray kills a dying worker's direct children, but not their descendants, so a
    guard that is the worker's direct child would die with it and leave the
    server running. The stub only waits for the guard and exits with its code.
    """
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # lead our own group, so ending "the group" never reaches our parent's
    guard = os.fork()
    if guard == 0:
        code = 1
        try:
            code = _guard(watch_pid, vllm_args)
        finally:
            os._exit(code)
    _, status = os.waitpid(guard, 0)
    return os.waitstatus_to_exitcode(status)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "--watch-pid" or argv[2] != "--":
        print(
            "usage: python -m rlcore_vllm.server --watch-pid PID -- <api_server args>",
            file=sys.stderr,
        )
        return 2
    return _launch(int(argv[1]), argv[3:])


if __name__ == "__main__":
    sys.exit(main())
