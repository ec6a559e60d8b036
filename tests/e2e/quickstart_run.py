"""The quickstart run the e2e tests share (started once per session by ``tests/e2e/conftest.py``).

``rlcore run examples/quickstart.yaml`` in a subprocess, as a user starts it, for
:data:`STEPS` steps, saving checkpoints (:data:`CHECKPOINTS`); every socket its process tree
listens on is sampled while it runs. tests/e2e/test_e2e_quickstart.py checks the run from
several angles and resumes a stopped twin of it; tests/e2e/test_e2e_export.py exports its
checkpoints.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from rlcore.testing.fixtures import listening_sockets

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "examples" / "quickstart.yaml")
RLCORE = Path(sys.executable).with_name("rlcore")
STEPS = 12
#: The shared run saves checkpoints (issue 33): at steps 4, 8 and 12, the last two kept.
CHECKPOINTS = ["checkpoint.every_steps=4", "checkpoint.keep=2"]


@dataclass
class Quickstart:
    dir: Path
    #: The run's artifact cache (``setup.cache_dir``): the tiny model it started from.
    cache: Path
    #: Every listening TCP socket and bound UDP socket seen in the run's process tree
    #: (Ray's GCS, raylet and agents, the worker actors, vLLM inside them, the driver),
    #: and the name of the process that had it.
    sockets: dict[tuple[str, int, str], str]
    output: str


def run_quickstart(run_dir: Path, cache: Path) -> Quickstart:
    """The run, to its end; fails (with its output's tail) unless it exits 0."""
    proc = subprocess.Popen(
        [str(RLCORE), "run", QUICKSTART, f"grpo.steps={STEPS}", *CHECKPOINTS, f"setup.cache_dir={cache}",
         "--out", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )
    seen: dict[tuple[str, int, str], str] = {}
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    for sock in listening_sockets(p):
                        seen.setdefault(sock, p.name())
                except psutil.Error:
                    pass  # exited meanwhile
            time.sleep(0.1)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    return Quickstart(run_dir, cache, seen, output)


def stop_at_line(cmd: list[str], prefix: str, **popen: object) -> tuple[int, str]:
    """Runs ``cmd`` and sends it SIGTERM once a line of its output starts with ``prefix``
    (a preempted run); its exit code and whole output, once it has exited."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)  # type: ignore[call-overload]
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(prefix):
                proc.send_signal(signal.SIGTERM)
                break
        return proc.wait(timeout=600), "".join(lines) + proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
