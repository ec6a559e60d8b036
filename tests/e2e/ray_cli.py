"""What the end-to-end tests that start Ray clusters of their own with Ray's CLI share: the
venv's commands and an environment of a home directory of its own, so that a token on this
machine never reaches the cluster under test (each test generates its own, or none)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RLCORE, RAY = BIN / "rlcore", BIN / "ray"
LOOPBACK = "127.0.0.1"
#: Ray's variables a test's own environment never inherits (they would point at another cluster or token).
INHERITED = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def home_env(home: Path, *, token: bool = False, pythonpath: bool = False) -> dict[str, str]:
    """The environment of Ray commands run with ``home`` as ``HOME`` (made here); ``token``:
    one generated there first (``ray get-auth-token --generate``); ``pythonpath``: the
    caller's ``PYTHONPATH`` kept (the in-tree plugins on it)."""
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HOME": str(home), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    if pythonpath:
        env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    for name in INHERITED:
        env.pop(name, None)
    if token:
        subprocess.run([str(RAY), "get-auth-token", "--generate"], env=env, capture_output=True, check=True, timeout=60)
    return env


def alive_nodes(env: dict[str, str], address: str) -> int | None:
    """How many nodes of the cluster at ``address`` are alive, asked of its GCS with the
    token of ``env``'s home (None: the GCS did not answer)."""
    code = (
        "import sys; from ray._raylet import GcsClient; "
        "print(sum(1 for n in GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5).values() if n.state == 0))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, address], env={**env, "RAY_AUTH_MODE": "token"},
        capture_output=True, text=True, timeout=60,
    )
    lines = out.stdout.strip().splitlines()
    return int(lines[-1]) if out.returncode == 0 and lines and lines[-1].isdigit() else None


def still_running(procs: list[psutil.Process]) -> list[str]:
    """``pid: command line`` of each of ``procs`` still running (zombies are gone)."""
    left = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid}: {' '.join(p.cmdline())[:100]}")
    return left
