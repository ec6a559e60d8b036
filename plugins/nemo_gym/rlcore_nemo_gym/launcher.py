"""Runs NeMo Gym's servers; executed by the *Gym venv's* Python, never imported by rlcore.

``python -I launcher.py SPEC.json`` (started by :class:`rlcore_nemo_gym.handle.GymServers`
in a process group of its own):

1. reads the spec (env, config, ports, endpoint file...) written by the plugin;
2. checks the config and the head port, builds a "venv farm" (every server's
   ``.venv`` is a symlink to this venv, so Gym neither calls uv nor builds venvs);
3. starts Gym's head server and every server of the config with
   ``nemo_gym.cli.env.RunHelper`` (Ray disabled: here by patching
   ``initialize_ray``, in the servers through ``_gym_site/sitecustomize.py``)
   and waits until they all answer;
4. writes a status file (JSON, replaced atomically): ``{"state": "ready", ...}``
   with the URL to POST rows to, or ``{"state": "failed", "error": ...}``;
5. keeps the servers up until a ``stop`` line or end-of-file on stdin (the
   plugin's process died: its pipe closed), SIGTERM or SIGINT, or until a
   server dies (state ``failed``); then stops them with Gym's own shutdown.

The policy model's URL is not known at start: Gym's model server reads it from
``endpoint_file`` (a Gym feature for endpoints that move), which the plugin
writes once rlcore posts the ``generation.endpoint`` event. Only the stdlib is
imported at module level; this file must not import rlcore (not in this venv).
"""

from __future__ import annotations

import difflib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

SERVER_TYPES = (
    "resources_servers",
    "responses_api_agents",
    "responses_api_models",
    "environment_servers",
)
_T0 = time.monotonic()
#: Longest sleep between RunHelper's readiness polls (Gym's own: 3 s).
POLL_S = 0.2


class LaunchError(Exception):
    """A problem the plugin should report as it is (``kind`` says whose fault)."""

    def __init__(self, message: str, kind: str = "start", key: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.key = key  # the rlcore option at fault, for kind "config"


def _elapsed() -> float:
    return round(time.monotonic() - _T0, 3)


def write_status(path: Path, **fields: Any) -> None:
    """Replace the status file in one step (readers never see half a file)."""
    fields.setdefault("pid", os.getpid())
    fields.setdefault("elapsed_s", _elapsed())
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(fields))
    os.replace(tmp, path)


def log(msg: str) -> None:
    print(f"[rlcore-nemo-gym launcher +{_elapsed():.2f}s] {msg}", flush=True)


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            raise LaunchError(
                f"Gym head server port 127.0.0.1:{port} is not free ({err.strerror}); "
                "set env.options.head_port to a free port or 0 (pick one)",
                kind="port",
            ) from None


def _gym_root() -> Path:
    import nemo_gym

    return Path(nemo_gym.__file__).resolve().parent.parent


def _known_envs(root: Path) -> list[str]:
    base = root / "resources_servers"
    return (
        sorted(p.name for p in base.iterdir() if (p / "configs").is_dir()) if base.is_dir() else []
    )


def _resolve(root: Path, rel: str) -> Path:
    p = Path(rel)
    return p if p.is_absolute() else root / p


def check_config(spec: dict[str, Any], root: Path) -> Path:
    """The config file of the env; a clear error naming the env when it does not exist."""
    env = spec["env_name"]
    rel = spec.get("config_path") or f"resources_servers/{env}/configs/{env}.yaml"
    path = _resolve(root, rel)
    if path.is_file():
        return path
    known = _known_envs(root)
    if not spec.get("config_path") and env not in known:
        close = difflib.get_close_matches(env, known, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise LaunchError(
            f"NeMo Gym has no environment '{env}' (no resources_servers/{env}/configs/ under {root}).{hint} "
            f"{len(known)} environments are installed, e.g. {', '.join(known[:6])}",
            kind="config",
            key="env.options.env_name",
        )
    raise LaunchError(
        f"Gym config file {path} does not exist (env '{env}')",
        kind="config",
        key="env.options.config_path" if spec.get("config_path") else "env.options.env_name",
    )


def _servers(config: Any) -> dict[str, tuple[str, str, Any]]:
    """``{top-level name: (server type, server kind, inner config)}`` of every server in the config."""
    from omegaconf import DictConfig

    out = {}
    for name, block in config.items():
        if not isinstance(block, DictConfig) or len(block) != 1:
            continue
        stype = next(iter(block.keys()))
        if (
            stype not in SERVER_TYPES
            or not isinstance(block[stype], DictConfig)
            or len(block[stype]) != 1
        ):
            continue
        kind = next(iter(block[stype].keys()))
        inner = block[stype][kind]
        if isinstance(inner, DictConfig) and "entrypoint" in inner:
            out[str(name)] = (str(stype), str(kind), inner)
    return out


def build_farm(farm: Path, servers: dict[str, tuple[str, str, Any]]) -> None:
    """``<farm>/<type>/<kind>/.venv`` -> this venv for every server: Gym runs them with it."""
    prefix = Path(sys.prefix)
    for stype, kind, _ in servers.values():
        link = farm / stype / kind / ".venv"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(prefix, target_is_directory=True)


def describe(spec: dict[str, Any], config: Any, root: Path) -> dict[str, Any]:
    """Where to send rows (env server, else agent), the agent's name and the rows' file."""
    servers = _servers(config)
    agents = [n for n, (t, _, _) in servers.items() if t == "responses_api_agents"]
    agent = spec.get("agent_name")
    if agent is None:
        if len(agents) != 1:
            raise LaunchError(
                f"the Gym config defines {len(agents)} agent servers ({', '.join(agents) or 'none'}); "
                "set env.options.agent_name to the one that runs the rows",
                kind="config",
                key="env.options.agent_name",
            )
        agent = agents[0]
    elif agent not in agents:
        raise LaunchError(
            f"env.options.agent_name '{agent}' is not an agent server of the Gym config "
            f"(agents: {', '.join(agents) or 'none'})",
            kind="config",
            key="env.options.agent_name",
        )

    def url(name: str) -> str:
        inner = servers[name][2]
        return f"http://{inner.host}:{inner.port}"

    target, target_kind = agent, "agent"
    for name, (stype, _, inner) in servers.items():
        ref = inner.get("agent_server")
        if stype == "environment_servers" and ref is not None and ref.get("name") == agent:
            target, target_kind = name, "environment server"
            break

    data = spec.get("data_path")
    if data is None:
        for ds in servers[agent][2].get("datasets") or []:
            fpath = ds.get("jsonl_fpath")
            if fpath and _resolve(root, str(fpath)).is_file():
                data = str(fpath)
                break
    if data is None:
        data = f"resources_servers/{spec['env_name']}/data/example.jsonl"
    data_file = _resolve(root, data)
    if not data_file.is_file():
        raise LaunchError(
            f"rows file {data_file} does not exist (env.options.data_path)",
            kind="config",
            key="env.options.data_path",
        )
    return {
        "agent_name": agent,
        "run_url": url(target) + "/run",
        "run_via": f"{target_kind} {target}",
        "data_path": str(data_file),
        "servers": {n: {"type": t, "kind": k, "url": url(n)} for n, (t, k, _) in servers.items()},
    }


def gym_config(spec: dict[str, Any], config_file: Path) -> dict[str, Any]:
    model_server = {
        "request_prompt_and_generation_token_ids": True,
        # Gym's model server reads the endpoint's URL from this file on every request
        # (interval 0) and rebinds its clients when the file changes.
        "endpoint_file": spec["endpoint_file"],
        "endpoint_check_interval_s": 0.0,
        "endpoint_connection_retries": 3,
    }
    return {
        "config_paths": [
            str(config_file),
            "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
        ],
        # Placeholder until the endpoint file is written: nothing listens on port 9.
        "policy_base_url": "http://127.0.0.1:9/v1",
        "policy_api_key": spec["api_key"],
        "policy_model_name": spec["model_name"],
        "policy_model": {"responses_api_models": {"vllm_model": model_server}},
        "default_host": "127.0.0.1",
        "head_server": {"host": "127.0.0.1", "port": spec["head_port"]},
        "skip_venv_if_present": True,
        "uv_venv_dir": spec["farm_dir"],
        # rlcore's generation.endpoint event says when the endpoint serves (after the
        # first refit); Gym's own probe would accept an engine still on dummy weights.
        "model_endpoint_readiness_timeout_seconds": 0,
        "server_spinup_timeout_seconds": spec["spinup_timeout_s"],
    }


class Stop:
    """Set by a ``stop`` line or EOF on stdin, SIGTERM or SIGINT. Before the servers are
    ready it interrupts the start (KeyboardInterrupt in the main thread)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.starting = True
        self.reason = ""

    def request(self, reason: str) -> None:
        if self.event.is_set():
            return
        self.reason = reason
        self.event.set()
        if self.starting:
            os.kill(os.getpid(), signal.SIGUSR1)

    def install(self) -> None:
        def on_signal(signum: int, frame: Any) -> None:
            self.request(signal.Signals(signum).name)

        def interrupt(signum: int, frame: Any) -> None:
            if self.starting:
                raise KeyboardInterrupt(self.reason)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGUSR1, interrupt)
        threading.Thread(target=self._watch_stdin, name="stdin-watch", daemon=True).start()

    def _watch_stdin(self) -> None:
        try:
            for line in sys.stdin:
                if line.strip() == "stop":
                    self.request("stop requested")
                    return
        except (OSError, ValueError):
            pass
        self.request("stdin closed (the rlcore process is gone)")


def _dead(helper: Any) -> dict[str, Any]:
    """Which server ended and its exit status (``server``, ``returncode``) for the status file."""
    for name, proc in getattr(helper, "_processes", {}).items():
        if proc.poll() is not None:
            return {"server": name, "returncode": proc.returncode}
    return {"server": "head", "returncode": None}  # RunHelper: its head server thread ended


def _load_gym(spec: dict[str, Any]) -> tuple[Any, Any, dict[str, Any], float]:
    """Import Gym, check and parse the config, build the venv farm.

    Returns Gym's ``nemo_gym.cli.env`` module (patched: no Ray, short polls), the parser
    config ``RunHelper`` starts from, :func:`describe`'s report and the import's seconds.
    """
    t = time.monotonic()
    import nemo_gym.cli.env as gym_env
    from nemo_gym.global_config import GlobalConfigDictParserConfig, get_global_config_dict
    from omegaconf import DictConfig

    import_s = time.monotonic() - t
    log(f"imported nemo_gym in {import_s:.2f}s")
    root = _gym_root()
    config_file = check_config(spec, root)
    gym_env.initialize_ray = lambda: None  # no Ray in this process (servers: sitecustomize)
    # RunHelper polls the head server and then every server with sleep(3) between
    # rounds; a cheap GET every 0.2 s instead saves seconds of start for nothing.
    gym_env.sleep = lambda seconds: time.sleep(min(seconds, POLL_S))
    parser_cfg = GlobalConfigDictParserConfig(
        initial_global_config_dict=DictConfig(gym_config(spec, config_file)),
        skip_load_from_cli=True,
        skip_load_from_dotenv=True,
    )
    config = get_global_config_dict(global_config_dict_parser_config=parser_cfg)
    info = describe(spec, config, root)
    build_farm(Path(spec["farm_dir"]), _servers(config))
    return gym_env, parser_cfg, info, import_s


def _start(spec: dict[str, Any], status: Path, stop: Stop) -> Any:
    """Start every Gym server and write the ``ready`` status; returns Gym's ``RunHelper``.
    Raises KeyboardInterrupt when a stop came during the start."""
    write_status(status, state="starting")
    _check_port_free(int(spec["head_port"]))
    gym_env, parser_cfg, info, import_s = _load_gym(spec)
    log(f"starting {len(info['servers'])} Gym servers: {', '.join(info['servers'])}")
    t = time.monotonic()
    helper = gym_env.RunHelper()
    helper.start(parser_cfg)  # same (cached) config; raises and cleans up on failure
    start_s = time.monotonic() - t
    stop.starting = False
    if stop.event.is_set():
        raise KeyboardInterrupt(stop.reason)
    log(f"Gym servers ready in {start_s:.2f}s")
    write_status(
        status, state="ready", import_s=round(import_s, 3), start_s=round(start_s, 3), **info
    )
    return helper


def _serve(helper: Any, status: Path, stop: Stop) -> int:
    """Keep the servers up until a stop (0) or a server's death (4, status ``failed``),
    then stop them with Gym's own shutdown."""
    code = 0
    while not stop.event.wait(1.0):
        try:
            helper.poll()  # raises when a server process has exited
        except Exception as err:
            log(f"a Gym server died: {err}")
            write_status(status, state="failed", kind="died", error=str(err)[:4000], **_dead(helper))
            code = 4
            break
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log(f"stopping Gym servers ({stop.reason or 'server died'})")
    try:
        helper.shutdown()
    finally:
        if code == 0:
            write_status(status, state="stopped", reason=stop.reason)
    return code


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    if spec.get("nice"):
        # Gym's start is off the setup's critical path (it has until the endpoint
        # event): let the inits on that path have the CPU first. Servers inherit it.
        os.nice(int(spec["nice"]))
    status = Path(spec["status_file"])
    stop = Stop()
    stop.install()
    try:
        helper = _start(spec, status, stop)
    except KeyboardInterrupt:
        stop.starting = False
        log(f"start interrupted: {stop.reason or 'interrupted'}")
        write_status(status, state="stopped", reason=stop.reason or "interrupted")
        return 0
    except LaunchError as err:
        stop.starting = False
        write_status(status, state="failed", kind=err.kind, key=err.key, error=str(err))
        return 3
    except BaseException as err:  # Gym raised: its servers are already shut down
        stop.starting = False
        log("start failed:\n" + traceback.format_exc())
        write_status(status, state="failed", kind="start", error=f"{type(err).__name__}: {err}")
        return 3
    return _serve(helper, status, stop)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
