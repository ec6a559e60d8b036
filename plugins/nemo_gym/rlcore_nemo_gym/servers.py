"""The Gym launcher as a child process of rlcore: start, watch, stop (rlcore's venv side).

:class:`GymServers` runs ``<gym python> -I launcher.py spec.json`` in a process
group of its own (``start_new_session``): Gym's head server lives in the
launcher, every Gym server is a descendant in the same group, so stopping ends
all of them. The launcher's stdin is a pipe from this process: if this process
dies without stopping it, the pipe closes and the launcher stops its servers.
Nothing here imports nemo_gym, and the launcher imports nothing of rlcore.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.errors import CancelToken, ConfigError, Deadline, DeadlineExceeded, RlcoreError
from rlcore.runtime.proc import group_members, log_tail, stop_group
from rlcore.runtime.server import find_venv_python

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
LAUNCHER = PACKAGE_DIR / "launcher.py"
SITE_DIR = PACKAGE_DIR / "_gym_site"
INSTALL_HINT = "bash install.sh --gym (it makes .venv-gym), or see plugins/nemo_gym/README.md"


class GymError(RlcoreError):
    """NeMo Gym's servers failed to start, died, or answered a rollout with an error."""


class GymServerDied(GymError):
    """A Gym server (or the launcher with the head server) is gone; the message names it."""


#: Gym's server types (the config's second level) in an operator's words.
SERVER_KINDS = {
    "resources_servers": "resources server",
    "responses_api_agents": "agent server",
    "responses_api_models": "model server",
    "environment_servers": "environment server",
}
#: How long a failure waits for the launcher to report a dead server's exit status (it
#: polls its servers every second).
REPORT_WAIT_S = 2.5
#: The environment variable Gym sets in each server process: the server's name in the config.
SERVER_NAME_ENV = "NEMO_GYM_CONFIG_PATH"
#: The Gym processes' environment for Ray, should any of them start it despite
#: ``RLCORE_GYM_NO_RAY``: never by auto-init, and bound to 127.0.0.1 (Ray's single-host
#: switch, which rlcore's embedded cluster uses too): Gym runs on this host only.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_AUTO_CONNECT": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def exit_status(code: int | None) -> str:
    """``exit code 3``, ``killed by SIGKILL``, or ``exit status not known yet``."""
    if code is None:
        return "exit status not known yet"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _running(proc: Any) -> bool:
    import psutil

    try:
        return bool(proc.is_running()) and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def find_gym_python(option: str | None) -> Path:
    """The Gym venv's python: the option, else ``$RLCORE_GYM_PYTHON``, else ``.venv-gym``
    beside the running venv or in a parent directory of this package (a source checkout).

    Raises :class:`ConfigError` naming ``env.options.gym_python`` and the install command.
    """
    return find_venv_python(
        option,
        key="env.options.gym_python",
        env_var="RLCORE_GYM_PYTHON",
        venv=".venv-gym",
        package_dir=PACKAGE_DIR,
        needs="backend 'nemo_gym' needs the NeMo Gym venv",
        install_hint=INSTALL_HINT,
        point_at="the Gym venv's python",
    )


def check_env_name(python: Path, env_name: str) -> None:
    """Fail at once, before anything starts, on an env Gym does not have.

    Looks for Gym's built-in environments in the Gym venv's site-packages (without
    importing Gym); if it cannot find them there (an editable or unusual install),
    the launcher checks again with Gym's own path rules.
    """
    import difflib

    venv = python.parent.parent
    roots = sorted(venv.glob("lib/python3*/site-packages/resources_servers"))
    if not roots or (roots[0] / env_name / "configs").is_dir():
        return
    known = sorted(p.name for p in roots[0].iterdir() if (p / "configs").is_dir())
    close = difflib.get_close_matches(env_name, known, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(
        f"env.options.env_name: NeMo Gym has no environment '{env_name}' (no "
        f"resources_servers/{env_name}/configs/ in {roots[0].parent}).{hint} "
        f"{len(known)} environments are installed, e.g. {', '.join(known[:6])}",
        key="env.options.env_name",
    )


def launcher_env() -> dict[str, str]:
    """The Gym launcher's whole environment: this process's, without anything of rlcore's
    venv, with only the sitecustomize that keeps Gym's servers off Ray, Ray on loopback."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    env.update(PYTHONPATH=str(SITE_DIR), RLCORE_GYM_NO_RAY="1", PYTHONUNBUFFERED="1")
    env.update(RAY_LOOPBACK_ENV)
    return env


@dataclass
class LaunchSpec:
    """What the launcher needs (written as JSON into the work directory)."""

    env_name: str
    config_path: str | None
    agent_name: str | None
    data_path: str | None
    model_name: str
    api_key: str
    head_port: int
    spinup_timeout_s: float
    workdir: Path
    nice: int = 0

    @classmethod
    def from_options(
        cls, o: Any, *, model_name: str, api_key: str, head_port: int, workdir: Path
    ) -> LaunchSpec:
        """The spec of ``env.options`` ``o`` (:class:`rlcore_nemo_gym.options.NemoGymOptions`)
        for one launch: Gym's model server named ``model_name`` and called with ``api_key``,
        the head server on ``head_port``, files under ``workdir``."""
        return cls(
            env_name=o.env_name,
            config_path=o.config_path,
            agent_name=o.agent_name,
            data_path=o.data_path,
            model_name=model_name,
            api_key=api_key,
            head_port=head_port,
            spinup_timeout_s=o.server_start_timeout_s,
            workdir=workdir,
            nice=o.nice,
        )

    @property
    def endpoint_file(self) -> Path:
        return self.workdir / "endpoint"

    def to_json(self) -> dict[str, Any]:
        return {
            "env_name": self.env_name,
            "config_path": self.config_path,
            "agent_name": self.agent_name,
            "data_path": self.data_path,
            "model_name": self.model_name,
            "api_key": self.api_key,
            "head_port": self.head_port,
            "spinup_timeout_s": self.spinup_timeout_s,
            "nice": self.nice,
            "farm_dir": str(self.workdir / "venvs"),
            "endpoint_file": str(self.endpoint_file),
            "status_file": str(self.workdir / "status.json"),
        }


class GymServers:
    """One launcher process and the Gym servers under it.

    Args:
        python: the Gym venv's python.
        spec: what to start.
        name: a label for errors and logs (``nemo_gym env bunsenbench_chemistry_mcq``).
    """

    def __init__(self, python: Path, spec: LaunchSpec, *, name: str) -> None:
        self.python = python
        self.spec = spec
        self.name = name
        self.workdir = spec.workdir
        self.status_path = spec.workdir / "status.json"
        self.log_path = spec.workdir / "gym.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None
        self.info: dict[str, Any] | None = None
        #: Each Gym server's process by its name in the config, found once they are ready.
        self.server_processes: dict[str, Any] = {}

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.status_path.unlink(missing_ok=True)
        spec_path = self.workdir / "spec.json"
        spec_path.touch(mode=0o600)  # it holds the API key (the run's token across nodes)
        spec_path.write_text(json.dumps(self.spec.to_json(), indent=1))
        env = launcher_env()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [str(self.python), "-I", str(LAUNCHER), str(spec_path)],
                cwd=self.workdir,  # Gym resolves relative paths against cwd first: keep it private
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() ends every Gym server
            )
        self.pgid = self.proc.pid
        log.info("%s: launcher pid %d (log %s)", self.name, self.proc.pid, self.log_path)

    def status(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return None

    def poll_ready(self) -> dict[str, Any] | None:
        """The launcher's ready record, ``None`` while starting; raises if the start failed."""
        if self.info is not None:
            return self.info
        assert self.proc is not None, "start() first"
        st = self.status()
        state = st.get("state") if st else None
        if state == "ready":
            self.info = st
            self.server_processes = self._find_server_processes()
            return st
        if state == "failed":
            if st.get("kind") == "config":
                raise ConfigError(f"{self.name}: {st.get('error')}", key=st.get("key"))
            raise GymError(
                f"{self.name}: NeMo Gym's servers failed to start: {st.get('error')}\n"
                f"end of {self.log_path}:\n{self.log_tail()}"
            )
        if self.proc.poll() is not None:
            raise GymError(
                f"{self.name}: the Gym launcher exited with code {self.proc.returncode} before its "
                f"servers were ready (state {state!r}); end of {self.log_path}:\n{self.log_tail()}"
            )
        return None

    def wait_ready(self, *, cancel: CancelToken, deadline: Deadline) -> dict[str, Any]:
        """Block until the servers are ready (cancellable, bounded)."""
        while True:
            info = self.poll_ready()
            if info is not None:
                return info
            cancel.raise_if_cancelled(f"{self.name}: waiting for Gym's servers")
            if deadline.expired:
                raise DeadlineExceeded(
                    f"{self.name}: Gym's servers were not ready within {deadline.seconds:g}s "
                    f"({deadline.what}); end of {self.log_path}:\n{self.log_tail()}"
                )
            cancel.sleep(min(0.1, deadline.remaining() or 0.1))

    def _find_server_processes(self) -> dict[str, Any]:
        """``{server name: psutil.Process}``: the topmost process of each Gym server
        (Gym starts each with its name in ``NEMO_GYM_CONFIG_PATH``)."""
        import psutil

        found: dict[str, Any] = {}
        for pid in self.pids():
            try:
                proc = psutil.Process(pid)
                name = proc.environ().get(SERVER_NAME_ENV)
                if not name:
                    continue
                parent = proc.parent()
                if parent is not None and parent.environ().get(SERVER_NAME_ENV) == name:
                    continue  # a child of the server's own process (a shell's python, a worker)
            except psutil.Error:
                continue
            found[name] = proc
        return found

    def describe_server(self, name: str) -> str:
        """``Gym's resources server 'x' (http://127.0.0.1:port)``."""
        if name == "head":
            pid = self.proc.pid if self.proc is not None else "?"
            return f"Gym's head server (in the launcher, pid {pid})"
        server = ((self.info or {}).get("servers") or {}).get(name) or {}
        kind = SERVER_KINDS.get(server.get("type"), "server")
        url = f" ({server['url']})" if server.get("url") else ""
        return f"Gym's {kind} '{name}'{url}"

    def dead_part(self) -> tuple[str, bool] | None:
        """What of Gym died, in words, and whether its exit status is known; ``None``
        while the launcher and every server run."""
        if self.proc is None:
            return None
        st = self.status() or {}
        if st.get("state") == "failed" and st.get("kind") == "died":
            name = str(st.get("server") or "?")
            if name == "head":
                return f"{self.describe_server('head')} stopped", True
            return f"{self.describe_server(name)} died ({exit_status(st.get('returncode'))})", True
        if self.proc.poll() is not None:
            return (
                f"the Gym launcher, which runs Gym's head server (pid {self.proc.pid}), exited "
                f"({exit_status(self.proc.returncode)})",
                True,
            )
        for name, proc in self.server_processes.items():
            if not _running(proc):
                return f"{self.describe_server(name)} died (pid {proc.pid})", False
        return None

    def wait_dead_part(self, timeout_s: float) -> str | None:
        """:meth:`dead_part`, waiting up to ``timeout_s`` for a death to be seen (a failed
        request is often the first sign) and for the launcher to report its exit status."""
        end = time.monotonic() + timeout_s
        while True:
            found = self.dead_part()
            if (found is not None and found[1]) or time.monotonic() >= end:
                return None if found is None else found[0]
            time.sleep(0.05)

    def alive(self) -> bool:
        """Launcher and every Gym server running, no dead server reported."""
        return self.proc is not None and self.dead_part() is None and (
            (self.status() or {}).get("state") != "failed"
        )

    def check_alive(self) -> None:
        """Raise a :class:`GymError` naming what died (server, kind, exit status, log tail)."""
        if self.alive():
            return
        dead = self.wait_dead_part(REPORT_WAIT_S)
        if dead is None:
            st = self.status() or {}
            dead = f"NeMo Gym's servers are gone ({st.get('error') or 'launcher not started'})"
        raise GymServerDied(f"{self.name}: {dead}; end of {self.log_path}:\n{self.log_tail()}")

    # ------------------------------------------------------------------ endpoint

    def publish_endpoint(self, base_url: str) -> None:
        """Tell Gym's model server where the policy is (it re-reads the file per request)."""
        path = self.spec.endpoint_file
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(base_url + "\n")
        os.replace(tmp, path)

    # ------------------------------------------------------------------ stop

    def pids(self) -> list[int]:
        """Every live process of the launcher's group (itself and all Gym servers)."""
        return [] if self.pgid is None else group_members(self.pgid)

    def stop(self, grace_s: float = 15.0, term_s: float = 3.0) -> None:
        """Ask the launcher to stop its servers; after ``grace_s`` end the whole group (SIGTERM,
        SIGKILL ``term_s`` later). Idempotent."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.write(b"stop\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            if grace_s > 0:
                log.warning(
                    "%s: launcher did not stop within %gs; killing its process group",
                    self.name,
                    grace_s,
                )
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        # Whatever is left of the group (a server that ignored SIGINT, a grandchild).
        stop_group(self.pgid, term_s, reap=[proc], what=self.name)
        proc.poll()

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)


