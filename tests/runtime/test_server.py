"""A server a worker starts (rlcore.runtime.server) under rlcore's guard (rlcore.runtime.guard):
real processes, real HTTP, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlcore.errors import ConfigError
from rlcore.runtime.addresses import free_port
from rlcore.runtime.proc import group_members
from rlcore.runtime.server import GuardedServer, ServerError, find_venv_python
from rlcore.testing.waits import wait_for

#: A JSON server with the command line GuardedServer gives (``--host H --port P``).
SERVER = textwrap.dedent(
    """
    import argparse, json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    ap = argparse.ArgumentParser(); ap.add_argument("--host"); ap.add_argument("--port", type=int)
    ap.add_argument("--exit-at-once", action="store_true")
    a = ap.parse_args()
    if a.exit_at_once:
        print("cannot start: no model here", flush=True); sys.exit(3)
    class H(BaseHTTPRequestHandler):
        def answer(self, code, body):
            raw = json.dumps(body).encode()
            self.send_response(code); self.send_header("Content-Length", str(len(raw)))
            self.end_headers(); self.wfile.write(raw)
        def do_GET(self):
            self.answer(200, {"path": self.path, "auth": self.headers.get("Authorization")})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/bad":
                self.answer(400, {"message": "no such adapter"})
            else:
                self.answer(200, {"echo": body})
        def log_message(self, *a):
            pass
    HTTPServer((a.host, a.port), H).serve_forever()
    """
)


def _start(tmp_path: Path, *extra: str, token: str | None = None) -> GuardedServer:
    return GuardedServer(
        [sys.executable, "-c", SERVER, *extra], port=free_port(), log_path=tmp_path / "server.log",
        env={}, token=token, what="test server",
    )


def test_it_answers_json_names_http_errors_and_stops_its_whole_group(tmp_path: Path) -> None:
    server = _start(tmp_path, token="t0k")
    try:
        assert server.wait_ready(120) >= 0
        assert server.request("/models") == {"path": "/models", "auth": "Bearer t0k"}
        assert server.post("/echo", {"x": 1}) == {"echo": {"x": 1}}
        assert server.post("/echo") == {"echo": {}}
        with pytest.raises(ServerError, match="test server .*: POST /bad answered HTTP 400: no such adapter") as err:
            server.post("/bad", {})
        assert err.value.status == 400 and err.value.message == "no such adapter"
        members = group_members(server.pgid)
        assert len(members) >= 2  # the guard's stub, the guard and the server
    finally:
        server.stop()
    assert wait_for(lambda: not group_members(server.pgid), 30), group_members(server.pgid)
    server.stop()  # idempotent


def test_a_server_that_exits_during_start_is_named_with_its_log(tmp_path: Path) -> None:
    server = _start(tmp_path, "--exit-at-once")
    try:
        with pytest.raises(ServerError, match=r"(?s)test server exited with code 3 during start.*no model here"):
            server.wait_ready(120)
    finally:
        server.stop()


def test_beyond_loopback_it_needs_the_token(tmp_path: Path) -> None:
    with pytest.raises(ServerError, match="beyond loopback, needs the run's token"):
        GuardedServer(["true"], port=free_port(), log_path=tmp_path / "log", env={}, host="10.1.2.3")


def test_a_venvs_python_is_the_option_else_the_variable_else_a_venv_beside_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def find(option: str | None) -> Path:
        return find_venv_python(
            option, key="env.options.python", env_var="RLCORE_TEST_PYTHON", venv=".venv-test",
            package_dir=tmp_path / "src" / "pkg", needs="backend 'x' needs the test venv",
            install_hint="bash install.sh",
        )

    python = tmp_path / ".venv-test" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    monkeypatch.delenv("RLCORE_TEST_PYTHON", raising=False)
    with pytest.raises(ConfigError, match="python there") as err:
        find(None)  # not executable yet
    python.chmod(0o755)
    assert find(None) == python
    assert find(str(python)) == python
    monkeypatch.setenv("RLCORE_TEST_PYTHON", str(python))
    assert find(None) == python
    with pytest.raises(ConfigError) as err:
        find(str(tmp_path / "nope"))
    assert err.value.key == "env.options.python"
    assert str(err.value).startswith(
        f"backend 'x' needs the test venv, but env.options.python has no python there (looked at "
        f"{tmp_path / 'nope'}). Install it with bash install.sh, or point env.options.python "
        "(or $RLCORE_TEST_PYTHON) at its python"
    )
    monkeypatch.setenv("RLCORE_TEST_PYTHON", str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match=r"\$RLCORE_TEST_PYTHON has no python there"):
        find(None)


def test_the_guard_ends_the_server_when_the_worker_that_started_it_dies(tmp_path: Path) -> None:
    """The worker (here a plain child process) starts the server and is SIGKILLed without
    cleaning up: the guard sees it and ends the server's process group."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from rlcore.runtime.server import GuardedServer\n"
        f"s = GuardedServer([sys.executable, '-c', {SERVER!r}], port=int(sys.argv[1]), "
        "log_path=Path(sys.argv[2]), env={})\n"
        "s.wait_ready(120)\n"
        "print(s.pgid, flush=True)\n"
        "time.sleep(600)\n"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", script, str(free_port()), str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        pgid = int(worker.stdout.readline())  # type: ignore[union-attr]
        assert group_members(pgid)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(30)
        assert wait_for(lambda: not group_members(pgid), 60), f"server group {pgid} outlived its worker"
    finally:
        worker.kill()
        worker.wait(30)
